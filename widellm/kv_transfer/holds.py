"""The producer's leases: blocks of finished prompts kept for a consumer to pull.

The worker half owns them, not the scheduler: a hold ends (and its blocks may be freed) only
when no send of it is in progress, after a completed or broken-off pull, a release from the
consumer, or a lease that ran out. A consumer's heartbeat extends the lease.

A streamed prompt (see ``streams.py``) is held from its first step on, while it still runs:
such a *running* hold has no lease and does not end when its pull ends; it becomes an
ordinary hold when the prompt finishes (``add``), and ends at once then if its pull already
completed or its consumer let go. ``cancel`` ends a running hold whose request was aborted
or preempted (the scheduler frees those blocks itself).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(slots=True)
class _Hold:
    block_ids: list[int]
    expires_at: float
    num_sending: int = 0
    ended: bool = False
    running: bool = False  # its prompt still runs: no lease yet
    done: bool = False  # a pull completed, or the consumer released it


class HoldTable:
    """Thread-safe: the engine loop adds holds and collects ended ones; side-channel threads
    start and end sends, heartbeats and releases."""

    def __init__(self, lease_s: float, clock=time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._ended: set[str] = set()
        self.leases_expired = 0
        self.progress = threading.Event()  # set when a hold ends

    def add(self, request_id: str, block_ids: list[int]) -> None:
        """Hold a finished prompt's blocks under a lease (a running hold of it finishes)."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None or hold.ended:
                self._holds[request_id] = _Hold(list(block_ids), self.clock() + self.lease_s)
                return
            hold.block_ids = list(block_ids)
            hold.running = False
            hold.expires_at = self.clock() + self.lease_s
            if hold.done:
                self._end(request_id, hold)

    def add_running(self, request_id: str, new_block_ids: list[int]) -> None:
        """Hold a streamed prompt's blocks while it runs; later calls append new blocks."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None or hold.ended:
                self._holds[request_id] = _Hold(list(new_block_ids), float("inf"), running=True)
            else:
                hold.block_ids.extend(new_block_ids)

    def cancel(self, request_id: str) -> None:
        """End a running hold: its request was aborted or preempted, its blocks are gone."""
        with self._lock:
            if (hold := self._holds.get(request_id)) is not None and hold.running:
                hold.running = False
                hold.done = True
                self._end(request_id, hold)

    def block_ids(self, request_id: str) -> list[int] | None:
        """The blocks held for ``request_id`` now (None: no live hold)."""
        with self._lock:
            hold = self._holds.get(request_id)
            return None if hold is None or hold.ended else list(hold.block_ids)

    def is_live(self, request_id: str) -> bool:
        with self._lock:
            hold = self._holds.get(request_id)
            return hold is not None and not hold.ended

    def begin_send(self, request_id: str, block_ids: list[int] | None) -> str | None:
        """Claim the hold for one send of ``block_ids`` (None: a streamed send, whose blocks
        are read as they are written); None, or why not (a cause)."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None or hold.ended:
                return "unknown_request"
            if block_ids is not None and not set(block_ids) <= set(hold.block_ids):
                return "layout"
            hold.num_sending += 1
            return None

    def end_send(self, request_id: str) -> None:
        """A send finished or broke off: the consumer will not pull again; the hold ends."""
        with self._lock:
            hold = self._holds[request_id]
            hold.num_sending -= 1
            hold.done = True
            self._end(request_id, hold)

    def heartbeat(self, request_ids: list[str]) -> list[str]:
        """Extend these leases; returns the ids not held (expired, released, never held)."""
        now = self.clock()
        unknown = []
        with self._lock:
            for rid in request_ids:
                hold = self._holds.get(rid)
                if hold is None or hold.ended:
                    unknown.append(rid)
                else:
                    hold.expires_at = max(hold.expires_at, now + self.lease_s)
        return unknown

    def release(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                if (hold := self._holds.get(rid)) is not None:
                    hold.done = True
                    self._end(rid, hold)

    def collect_ended(self) -> set[str]:
        """Expire leases that ran out, then hand over (and forget) every ended hold."""
        now = self.clock()
        with self._lock:
            for rid, hold in self._holds.items():
                if (not hold.ended and not hold.running and hold.num_sending == 0
                        and hold.expires_at <= now):
                    self.leases_expired += 1
                    self._end(rid, hold)
            ended, self._ended = self._ended, set()
            for rid in ended:
                # (A preempted streamed prompt may be held anew already: keep that hold.)
                if self._holds[rid].ended:
                    del self._holds[rid]
            self.progress.clear()
        return ended

    def counts(self) -> tuple[int, int]:
        """(requests held, blocks held) right now."""
        with self._lock:
            live = [h for h in self._holds.values() if not h.ended]
            return len(live), sum(len(h.block_ids) for h in live)

    def next_expiry_in(self) -> float | None:
        with self._lock:
            times = [h.expires_at for h in self._holds.values()
                     if not h.ended and not h.running]
        return None if not times else max(0.0, min(times) - self.clock())

    def _end(self, request_id: str, hold: _Hold) -> None:
        # Not while a send still reads the blocks (the last end_send ends it), nor while the
        # prompt still runs (``add`` ends it when it finishes).
        if hold.num_sending == 0 and not hold.ended and not hold.running:
            hold.ended = True
            self._ended.add(request_id)
            self.progress.set()
