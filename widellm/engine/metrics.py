"""Prometheus metrics with names parallel to vLLM's (``widellm:`` prefix), in a registry owned
by one AsyncLLM (no global registry: two engines in one process keep separate numbers), and a
periodic one-line throughput log."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from widellm.core.outputs import EplbStats
from widellm.core.scheduler_stats import SchedulerStats
from widellm.engine.kv_transfer_metrics import KVTransferMetrics

logger = logging.getLogger(__name__)

# Bucket edges in seconds, from sub-frame decode gaps to multi-minute CPU prefills.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
LOG_INTERVAL_S = 10.0
_ZERO_STATS = SchedulerStats(0, 0, 0.0, 0, 0, 0)


def _sum_stats(per_rank: list[SchedulerStats]) -> SchedulerStats:
    """All ranks as one: counts add up, KV usage is the mean over ranks."""
    if not per_rank:
        return _ZERO_STATS
    return SchedulerStats(
        sum(s.num_running_reqs for s in per_rank),
        sum(s.num_waiting_reqs for s in per_rank),
        sum(s.kv_cache_usage for s in per_rank) / len(per_rank),
        sum(s.prefix_cache_queries for s in per_rank),
        sum(s.prefix_cache_hits for s in per_rank),
        sum(s.num_preemptions for s in per_rank),
    )


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        # Per-rank numbers (one engine core per DP rank) carry the rank as a label.
        rank_labels = labels + ["rank"]
        r = self.registry
        self.num_requests_running = Gauge(
            "widellm:num_requests_running", "Requests in the running batch", rank_labels, registry=r)
        self.num_requests_waiting = Gauge(
            "widellm:num_requests_waiting", "Requests waiting to be scheduled", rank_labels, registry=r)
        self.kv_cache_usage_perc = Gauge(
            "widellm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", rank_labels,
            registry=r)
        self.prefix_cache_queries = Counter(
            "widellm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", rank_labels,
            registry=r)
        self.prefix_cache_hits = Counter(
            "widellm:prefix_cache_hits", "Prompt tokens found in the prefix cache", rank_labels,
            registry=r)
        self.num_preemptions = Counter(
            "widellm:num_preemptions", "Requests preempted for lack of KV blocks", rank_labels,
            registry=r)
        self.dbo_steps = Counter(
            "widellm:dbo_steps", "Forwards run as two overlapped micro-batches (--enable-dbo; "
            "a rank's dummy batches included)", rank_labels, registry=r)
        self.prompt_tokens = Counter(
            "widellm:prompt_tokens", "Prompt tokens of finished requests", labels, registry=r)
        self.generation_tokens = Counter(
            "widellm:generation_tokens", "Generated tokens", labels, registry=r)
        self.request_success = Counter(
            "widellm:request_success", "Finished requests by reason", labels + ["finished_reason"],
            registry=r)
        self.request_stalls = Counter(
            "widellm:request_stalls", "Requests that went --request-stall-timeout-s without a "
            "token (rank: the engine core serving them, 'none' if not routed)", rank_labels,
            registry=r)
        self.time_to_first_token = Histogram(
            "widellm:time_to_first_token_seconds", "Arrival to first token", labels,
            buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "widellm:inter_token_latency_seconds", "Gap between output chunks, per token", labels,
            buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "widellm:e2e_request_latency_seconds", "Arrival to finish", labels,
            buckets=E2E_BUCKETS, registry=r)
        # EPLB (all ranks measure the same global numbers; any rank's report sets them).
        self.eplb_balancedness = Gauge(
            "widellm:eplb_balancedness", "Mean over max of tokens per EP rank, per MoE layer, "
            "averaged over layers, over the last measurement window (1 = even)", labels,
            registry=r)
        self.eplb_num_rebalances = Gauge(
            "widellm:eplb_num_rebalances", "Expert placements applied since start", labels,
            registry=r)
        self.eplb_max_stall_seconds = Gauge(
            "widellm:eplb_max_stall_seconds", "Longest step delay caused by moving one layer's "
            "expert weights", labels, registry=r)
        self._labels = {"model_name": model_name}
        self.kv_transfer = KVTransferMetrics(r, self._labels)
        # Latest stats of each rank; the core reports running totals.
        self._last_core: dict[int, SchedulerStats] = {}
        self._last_log = time.monotonic()
        self._tokens_since_log = [0, 0]  # prompt, generation

    def record_scheduler_stats(self, stats: SchedulerStats, rank: int = 0) -> None:
        lb = {**self._labels, "rank": str(rank)}
        self.num_requests_running.labels(**lb).set(stats.num_running_reqs)
        self.num_requests_waiting.labels(**lb).set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc.labels(**lb).set(stats.kv_cache_usage)
        last = self._last_core.get(rank, _ZERO_STATS)
        # The core reports running totals; counters advance by the difference.
        self.prefix_cache_queries.labels(**lb).inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_cache_hits.labels(**lb).inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        self.num_preemptions.labels(**lb).inc(stats.num_preemptions - last.num_preemptions)
        self.dbo_steps.labels(**lb).inc(max(0, stats.num_dbo_steps - last.num_dbo_steps))
        if stats.kv_transfer is not None:
            self.kv_transfer.record(stats.kv_transfer, rank)
        self._last_core[rank] = stats

    def record_eplb(self, stats: EplbStats) -> None:
        if stats.num_measurements:
            self.eplb_balancedness.labels(**self._labels).set(stats.balancedness)
        self.eplb_num_rebalances.labels(**self._labels).set(stats.num_rebalances)
        self.eplb_max_stall_seconds.labels(**self._labels).set(stats.max_stall_s)

    def record_tokens(self, num_new_tokens: int, itl_s: float | None) -> None:
        self.generation_tokens.labels(**self._labels).inc(num_new_tokens)
        self._tokens_since_log[1] += num_new_tokens
        if itl_s is not None and num_new_tokens:
            per_token = itl_s / num_new_tokens
            for _ in range(num_new_tokens):
                self.inter_token_latency.labels(**self._labels).observe(per_token)

    def record_first_token(self, ttft_s: float) -> None:
        self.time_to_first_token.labels(**self._labels).observe(ttft_s)

    def record_finished(self, num_prompt_tokens: int, e2e_s: float, reason: str | None) -> None:
        self.prompt_tokens.labels(**self._labels).inc(num_prompt_tokens)
        self._tokens_since_log[0] += num_prompt_tokens
        self.e2e_request_latency.labels(**self._labels).observe(e2e_s)
        self.request_success.labels(**self._labels, finished_reason=reason or "abort").inc()

    def record_aborted(self) -> None:
        """A request ended by its client (disconnect, cancel) before it finished."""
        self.request_success.labels(**self._labels, finished_reason="abort").inc()

    def record_stall(self, rank: int | None) -> None:
        self.request_stalls.labels(**self._labels, rank="none" if rank is None else str(rank)).inc()

    def maybe_log(self) -> None:
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < LOG_INTERVAL_S:
            return
        s = _sum_stats(list(self._last_core.values()))
        prompt, gen = self._tokens_since_log
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        logger.info(
            "prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, "
            "waiting %d, KV cache usage %.1f%%, prefix cache hit rate %.1f%%",
            prompt / elapsed, gen / elapsed, s.num_running_reqs, s.num_waiting_reqs,
            100 * s.kv_cache_usage, 100 * hit_rate,
        )
        self._last_log = now
        self._tokens_since_log = [0, 0]
