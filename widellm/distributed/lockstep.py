"""Lockstep of data-parallel ranks under expert parallelism.

Every MoE layer is a collective over all ranks, so each rank must run one forward per step
(a dummy batch when it has no work). Before each step the ranks all-reduce two flags:
"I have work" and "I was told to shut down". They step while any has work and stop together
when any is shutting down. Idle ranks keep calling this at a short interval, so a rank that
gets a request pulls the others in at the next call without any wake-up message (and no
"wave" bookkeeping that a late message could leave one rank waiting on its own).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class GlobalState(NamedTuple):
    any_has_work: bool
    any_shutdown: bool


class DPLockstep:
    def __init__(self, cpu_group: dist.ProcessGroup) -> None:
        self.cpu_group = cpu_group
        self._flags = torch.zeros(2, dtype=torch.int32)

    def sync(self, has_work: bool, shutdown: bool) -> GlobalState:
        """Collective: every rank must call it once per loop iteration."""
        self._flags[0] = int(has_work)
        self._flags[1] = int(shutdown)
        dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return GlobalState(bool(self._flags[0]), bool(self._flags[1]))
