"""Wall time per phase of the engine step, summed over steps, for the step-time breakdown
that ``bench throughput`` reports (``--collect-step-breakdown``).

Phases (seconds, summed over the steps of one rank):
    schedule        scheduler.schedule + update_from_output
    forward         the model forward of real batches (attention, dense layers, MoE...)
    moe_dispatch    inside forward: MoE dispatch launch + wait (communication)
    moe_experts     inside forward: the routed experts' grouped GEMMs
    moe_combine     inside forward: MoE combine launch + wait (communication)
    comm_exposed    inside moe_dispatch/moe_combine: time blocked on a transfer (Work.wait)
    comm_window     for each transfer, the part of its life (launch to completion) before its
                    wait began: communication hidden behind other work
    sample          logits, sampling, logprobs
    dummy           forward of dummy batches (a rank with no work, in lockstep)
    lockstep_sync   the per-step all-reduce that keeps ranks in lockstep (waiting for peers)
    eplb            EPLB bookkeeping before a forward: load all-reduces, planning, weight moves

Timing is host wall time: exact on CPU; on GPU a phase only measures launch time unless the
device is synchronised, which the timer does when ``synchronize`` is set. Under dual-batch
overlap a phase entered on a micro-batch thread leaves out the time that thread waited for the
baton (``away_clock``), so phases add up to the forward's wall time instead of double counting.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from widellm.comm_trace import ExchangeLog


class StepTimer:
    def __init__(self, synchronize: bool = False, exchange_log: ExchangeLog | None = None,
                 idle: bool = False) -> None:
        self.totals: defaultdict[str, float] = defaultdict(float)
        self._sync = synchronize
        # Seconds the calling thread has spent waiting for another micro-batch (see the module
        # docstring); set by the dual-batch runner for the length of a split forward.
        self.away_clock: Callable[[], float] = never_away
        # Every MoE transfer, when traced (see widellm/comm_trace.py).
        self.exchange_log = exchange_log
        self.idle = idle

    def for_idle(self) -> StepTimer | None:
        """What a dummy batch's forward carries: with a trace on, a timer whose phases go
        nowhere but whose transfers join the trace flagged idle (the ranks' traces must list
        the same transfers to line up); without one, None (a dummy is timed whole)."""
        if self.exchange_log is None:
            return None
        return StepTimer(exchange_log=self.exchange_log, idle=True)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._sync:
            torch.cuda.synchronize()
        start, away = time.perf_counter(), self.away_clock()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - start - (self.away_clock() - away)

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] += seconds


def never_away() -> float:
    return 0.0


def maybe_phase(timer: StepTimer | None, name: str) -> contextlib.AbstractContextManager:
    """``timer.phase(name)``, or a no-op when timing is off (the common case)."""
    return timer.phase(name) if timer is not None else contextlib.nullcontext()


def summarize(totals: dict[str, float]) -> dict[str, float]:
    """The breakdown in the issue's terms: attention and dense layers, routed experts,
    communication (the MoE exchange stages, packing included; of it, the time blocked on
    transfers is ``comm_exposed_s``), ``comm_hidden_s`` (transfer time that passed while the
    rank computed, see ``layers/moe/comm_tracking.py``), idle (dummy batches + lockstep
    waits), sampling and scheduling. Decode steps replayed as graphs count whole in
    ``graph_replay_s`` (a graph cannot be timed inside)."""
    moe = totals.get("moe_dispatch", 0.0) + totals.get("moe_combine", 0.0)
    experts = totals.get("moe_experts", 0.0)
    return {
        "attention_and_dense_s": totals.get("forward", 0.0) - moe - experts,
        "experts_s": experts,
        "communication_s": moe,
        "comm_exposed_s": totals.get("comm_exposed", 0.0),
        "comm_hidden_s": totals.get("comm_window", 0.0),
        "idle_s": totals.get("dummy", 0.0) + totals.get("lockstep_sync", 0.0),
        "sample_s": totals.get("sample", 0.0),
        "schedule_s": totals.get("schedule", 0.0),
        "eplb_s": totals.get("eplb", 0.0),
        "graph_replay_s": totals.get("graph_replay", 0.0),
    }
