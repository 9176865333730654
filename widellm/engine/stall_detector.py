"""Stall detection in the frontend: a request in flight that has had no token for
``request_stall_timeout_s`` is logged with the state of the engine core serving it and counted
in ``widellm:request_stalls``.

It runs in the frontend, not in the core, so that it also catches a core stuck inside a step
(which reports nothing): the output loop calls ``check`` every time it wakes, with or without
output. A stalled request is reported once per stall; a token ends the stall.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from widellm.core.scheduler_stats import SchedulerStats
from widellm.engine.metrics import EngineMetrics

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Tracked:
    core_ids: list[str]
    last_progress: float  # monotonic time of its last token (or of its arrival)
    reported: bool = False  # this stall is already logged and counted


class StallDetector:
    """Args:
        timeout_s: seconds without a token that make a stall (0: never check).
        metrics: where stalls are counted.
        rank_of: core request id -> the rank serving it (None once finished).
    """

    def __init__(self, timeout_s: float, metrics: EngineMetrics,
                 rank_of: Callable[[str], int | None]) -> None:
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.rank_of = rank_of
        self._tracked: dict[str, _Tracked] = {}
        self._parent: dict[str, str] = {}  # core request id -> its request
        # Per rank: its latest stats and the monotonic time they arrived.
        self._core_stats: dict[int, SchedulerStats] = {}
        self._core_reported: dict[int, float] = {}

    def add(self, request_id: str, core_ids: list[str]) -> None:
        self._tracked[request_id] = _Tracked(core_ids, time.monotonic())
        self._parent.update(dict.fromkeys(core_ids, request_id))

    def tokens_arrived(self, core_id: str) -> None:
        """The core sent tokens for ``core_id`` (counted even where the detokenizer holds
        the text back, e.g. for a possible stop string: the engine did not stall)."""
        request_id = self._parent.get(core_id)
        tracked = self._tracked.get(request_id) if request_id is not None else None
        if tracked is not None:
            tracked.last_progress = time.monotonic()
            tracked.reported = False

    def remove(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            for core_id in tracked.core_ids:
                self._parent.pop(core_id, None)

    def core_reported(self, rank: int, stats: SchedulerStats | None) -> None:
        self._core_reported[rank] = time.monotonic()
        if stats is not None:
            self._core_stats[rank] = stats

    def check(self) -> list[str]:
        """Log and count every request that has just crossed the timeout; returns their ids."""
        if not self.timeout_s:
            return []
        now = time.monotonic()
        stalled = []
        for request_id, tracked in self._tracked.items():
            idle = now - tracked.last_progress
            if tracked.reported or idle < self.timeout_s:
                continue
            tracked.reported = True
            rank = next((r for r in map(self.rank_of, tracked.core_ids) if r is not None), None)
            logger.warning("request %s has had no token for %.1f s; %s", request_id, idle,
                           self.describe_core(rank, now))
            self.metrics.record_stall(rank)
            stalled.append(request_id)
        return stalled

    def describe_core(self, rank: int | None, now: float) -> str:
        if rank is None:
            return "no engine core is serving it (not yet routed or already finished)"
        stats = self._core_stats.get(rank)
        reported = self._core_reported.get(rank)
        since = f"{now - reported:.1f} s ago" if reported is not None else "never"
        if stats is None:
            return f"engine core {rank} has sent no stats yet (last report: {since})"
        return (f"engine core {rank}: {stats.num_steps} steps, {stats.num_running_reqs} running, "
                f"{stats.num_waiting_reqs} waiting, last step took "
                f"{stats.last_step_duration_s:.3f} s, last report {since}")
