"""The numbers a scheduler reports each step (to the frontend's metrics and stall check)."""

from __future__ import annotations

from dataclasses import dataclass

from widellm.kv_transfer.stats import KVTransferStats


@dataclass(slots=True)
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Filled in by the engine core (the scheduler does not time steps): steps taken since
    # start and the wall time of the latest, which the frontend logs when a request stalls.
    num_steps: int = 0
    last_step_duration_s: float = 0.0
    # Forwards (real or dummy) run as two overlapped micro-batches (dual-batch overlap).
    num_dbo_steps: int = 0
    # KV connector counters (None without one); filled in by the engine core.
    kv_transfer: KVTransferStats | None = None
    # Lockstep ranks: seconds spent waiting on peers' votes inside waves of steps and running
    # dummy batches, since start (the engine core's clock).
    lockstep_idle_s: float = 0.0
