"""Exposed and hidden communication of the MoE transfers, for the step breakdown.

A backend wraps each ``async_op=True`` work handle it launches in :func:`track`; waiting on
the wrapper adds to the forward context's step timer the time blocked (``comm_exposed``) and
the time the transfer was in flight between its launch and that wait (``comm_window``: spent on
the shared experts, on packing, or, under dual-batch overlap, on the other micro-batch). With
no timer it only forwards ``wait``.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from widellm.forward_context import current_forward_context
from widellm.step_timer import StepTimer


class TrackedWork:
    """A launched transfer: ``wait()`` blocks on it and records how much of it was exposed."""

    __slots__ = ("work", "timer", "launched_at")

    def __init__(self, work: dist.Work, timer: StepTimer | None) -> None:
        self.work, self.timer = work, timer
        self.launched_at = time.perf_counter()

    def wait(self) -> None:
        if self.timer is None:
            self.work.wait()
            return
        start = time.perf_counter()
        self.work.wait()
        self.timer.add("comm_exposed", time.perf_counter() - start)
        self.timer.add("comm_window", start - self.launched_at)


def track(work: dist.Work) -> TrackedWork:
    """Wrap a just-launched work handle (in the current forward context, if any)."""
    ctx = current_forward_context()
    return TrackedWork(work, ctx.step_timer if ctx is not None else None)
