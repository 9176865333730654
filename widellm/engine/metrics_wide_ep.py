"""Prometheus metrics of a wide expert-parallel deployment, per engine (data-parallel rank):
EPLB balance, per-rank expert load and the steps' waits on weight moves, lockstep idle time,
dual-batch-overlap steps, and (with ``--collect-step-breakdown``) the step-time phases, the
MoE all-to-all among them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from widellm.core.outputs import EplbStats
from widellm.core.scheduler_stats import SchedulerStats


class WideEPMetrics:
    def __init__(self, registry: CollectorRegistry, labels: dict[str, str],
                 num_engines: int) -> None:
        self._labels = labels
        names = [*labels, "engine"]
        r = registry
        self.dbo_steps = Counter(
            "widellm:dbo_steps", "Forwards run as two overlapped micro-batches (--enable-dbo; "
            "a rank's dummy batches included)", names, registry=r)
        self.lockstep_idle = Counter(
            "widellm:lockstep_idle_seconds", "Time a lockstep rank spent idle inside waves of "
            "steps: waiting on its peers' votes and running dummy batches", names, registry=r)
        for e in range(num_engines):  # zero from the start, on every rank
            self.dbo_steps.labels(**labels, engine=str(e))
            self.lockstep_idle.labels(**labels, engine=str(e))
        # EPLB: each rank reports the numbers all ranks agreed on; they appear once EPLB runs.
        self.eplb_balancedness = Gauge(
            "widellm:eplb_balancedness", "Mean over max of tokens per EP rank, per MoE layer, "
            "averaged over layers, over the last measurement window (1 = even)", names,
            registry=r)
        self.eplb_num_rebalances = Gauge(
            "widellm:eplb_num_rebalances", "Expert placements applied since start", names,
            registry=r)
        self.eplb_max_stall_seconds = Gauge(
            "widellm:eplb_max_stall_seconds", "Longest step delay caused by moving one layer's "
            "expert weights", names, registry=r)
        self.eplb_stall_seconds = Counter(
            "widellm:eplb_stall_seconds", "Step delays caused by moving expert weights, summed",
            names, registry=r)
        self.eplb_rank_expert_load = Gauge(
            "widellm:eplb_rank_expert_load", "Tokens the experts placed on this EP rank computed "
            "in the last EPLB measurement window, summed over MoE layers", names, registry=r)
        self.step_phase_seconds = Counter(
            "widellm:step_phase_seconds", "Step wall time by phase (--collect-step-breakdown; "
            "moe_dispatch + moe_combine: the MoE all-to-all, comm_exposed: time blocked on "
            "it)", [*names, "phase"], registry=r)
        self._last_stall_s: dict[int, float] = {}
        self._last_phases: dict[int, dict[str, float]] = {}

    def record_scheduler_stats(self, stats: SchedulerStats, last: SchedulerStats,
                               engine: int) -> None:
        lb = {**self._labels, "engine": str(engine)}
        self.dbo_steps.labels(**lb).inc(max(0, stats.num_dbo_steps - last.num_dbo_steps))
        self.lockstep_idle.labels(**lb).inc(max(0.0, stats.lockstep_idle_s - last.lockstep_idle_s))

    def record_eplb(self, stats: EplbStats, engine: int) -> None:
        lb = {**self._labels, "engine": str(engine)}
        if stats.num_measurements:
            self.eplb_balancedness.labels(**lb).set(stats.balancedness)
        self.eplb_num_rebalances.labels(**lb).set(stats.num_rebalances)
        self.eplb_max_stall_seconds.labels(**lb).set(stats.max_stall_s)
        last = self._last_stall_s.get(engine, 0.0)
        self.eplb_stall_seconds.labels(**lb).inc(max(0.0, stats.total_stall_s - last))
        self._last_stall_s[engine] = stats.total_stall_s
        for rank, load in enumerate(stats.rank_load):
            self.eplb_rank_expert_load.labels(**self._labels, engine=str(rank)).set(load)

    def record_step_breakdown(self, totals: dict[str, float], engine: int) -> None:
        """``totals``: a rank's seconds per phase since start (``StepTimer.totals``)."""
        last = self._last_phases.get(engine, {})
        for phase, seconds in totals.items():
            self.step_phase_seconds.labels(**self._labels, engine=str(engine), phase=phase).inc(
                max(0.0, seconds - last.get(phase, 0.0)))
        self._last_phases[engine] = dict(totals)
