"""Exposed and hidden communication of the MoE transfers, for the step breakdown.

A backend wraps each ``async_op=True`` work handle it launches in :func:`track`. With a step
timer in the forward context the wrapper notes when the transfer completes (a callback on the
work's future, run by the process group's thread) and, when waited on, adds to the timer:

- ``comm_exposed``: the time the caller blocked in ``wait``;
- ``comm_window``: the part of the transfer's life (launch to completion) that passed before
  the wait began, i.e. while the rank did other work (the shared experts, packing, or under
  dual-batch overlap the other micro-batch): the communication hidden behind compute.

A transfer's life includes waiting for the slowest peer to launch its side, so both numbers
count skew between ranks as communication, as a profiler would. A work handle without a
future (gloo's all-gather and reduce-scatter into one tensor) counts as in flight until its
wait. With no timer the wrapper only forwards ``wait``; with the timer's exchange log on, each
transfer is also logged (``widellm/comm_trace.py``).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from widellm.comm_trace import Exchange
from widellm.forward_context import current_forward_context
from widellm.step_timer import StepTimer


class TrackedWork:
    """A launched transfer: ``wait()`` blocks on it and records how much of it was exposed."""

    __slots__ = ("work", "timer", "launched_at", "done_at", "seq", "tokens")

    def __init__(self, work: dist.Work, timer: StepTimer | None, tokens: int = -1) -> None:
        self.work, self.timer, self.tokens = work, timer, tokens
        self.launched_at = time.perf_counter()
        self.done_at: float | None = None
        log = timer.exchange_log if timer is not None else None
        self.seq = log.next_seq() if log is not None else -1
        if timer is not None:
            try:
                work.get_future().add_done_callback(self._completed)
            except RuntimeError:  # gloo's all-gather / reduce-scatter "into tensor" have none
                pass

    def _completed(self, _future) -> None:
        self.done_at = time.perf_counter()

    def wait(self) -> None:
        if self.timer is None:
            self.work.wait()
            return
        start = time.perf_counter()
        self.work.wait()
        end = time.perf_counter()
        # Without a completion time (no future) the transfer counts as in flight until the wait
        # began: exact when the wait blocks, an upper bound when it was done before.
        done = self.done_at if self.done_at is not None else start
        self.timer.add("comm_exposed", end - start)
        self.timer.add("comm_window", max(0.0, min(done, start) - self.launched_at))
        if self.timer.exchange_log is not None:
            self.timer.exchange_log.add(Exchange(self.seq, self.launched_at, self.done_at,
                                                 start, end, self.timer.idle, self.tokens))


def track(work: dist.Work) -> TrackedWork:
    """Wrap a just-launched work handle (in the current forward context, if any)."""
    ctx = current_forward_context()
    timer = ctx.step_timer if ctx is not None else None
    if timer is None or timer.exchange_log is None:  # every MoE transfer: keep it cheap
        return TrackedWork(work, timer)
    dp = ctx.dp_metadata
    return TrackedWork(work, timer, dp.max_num_tokens if dp is not None else -1)
