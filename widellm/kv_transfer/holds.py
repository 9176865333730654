"""The producer's leases: blocks of finished prompts kept for a consumer to pull.

The worker half owns them, not the scheduler: a hold ends (and its blocks may be freed) only
when no send of it is in progress, after a completed or broken-off pull, a release from the
consumer, or a lease that ran out. A consumer's heartbeat extends the lease.
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
        with self._lock:
            self._holds[request_id] = _Hold(list(block_ids), self.clock() + self.lease_s)

    def begin_send(self, request_id: str, block_ids: list[int]) -> str | None:
        """Claim the hold for one send of ``block_ids``; None, or why not (a cause)."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None or hold.ended:
                return "unknown_request"
            if not set(block_ids) <= set(hold.block_ids):
                return "layout"
            hold.num_sending += 1
            return None

    def end_send(self, request_id: str) -> None:
        """A send finished or broke off: the consumer will not pull again; the hold ends."""
        with self._lock:
            hold = self._holds[request_id]
            hold.num_sending -= 1
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
                    self._end(rid, hold)

    def collect_ended(self) -> set[str]:
        """Expire leases that ran out, then hand over (and forget) every ended hold."""
        now = self.clock()
        with self._lock:
            for rid, hold in self._holds.items():
                if not hold.ended and hold.num_sending == 0 and hold.expires_at <= now:
                    self.leases_expired += 1
                    self._end(rid, hold)
            ended, self._ended = self._ended, set()
            for rid in ended:
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
            times = [h.expires_at for h in self._holds.values() if not h.ended]
        return None if not times else max(0.0, min(times) - self.clock())

    def _end(self, request_id: str, hold: _Hold) -> None:
        # Not while a send still reads the blocks: the last end_send ends it.
        if hold.num_sending == 0 and not hold.ended:
            hold.ended = True
            self._ended.add(request_id)
            self.progress.set()
