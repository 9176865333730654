"""Prometheus metrics with vLLM's V1 names and meanings under the ``widellm:`` prefix, in a
registry owned by one AsyncLLM (no global registry: two engines in one process keep separate
numbers), and a periodic one-line throughput log.

Every engine metric is labelled ``model_name`` and ``engine`` (the data-parallel rank, vLLM's
label name). This module holds the scheduler state of each engine, ``cache_config_info``
and the process / platform / Python GC collectors; ``metrics_request`` the per-request
counters and histograms, ``metrics_wide_ep`` EPLB, lockstep and step-phase numbers,
``kv_transfer_metrics`` the KV connector's.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, GCCollector, PlatformCollector, ProcessCollector,
)

from widellm.config import CacheConfig, EngineConfig
from widellm.core.outputs import EplbStats
from widellm.core.scheduler_stats import SchedulerStats
from widellm.engine.iteration_stats import IterationStats
from widellm.engine.kv_transfer_metrics import KVTransferMetrics
from widellm.engine.metrics_request import NO_ENGINE, PerEngine, RequestMetrics
from widellm.engine.metrics_wide_ep import WideEPMetrics

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
_ZERO_STATS = SchedulerStats(0, 0, 0.0, 0, 0, 0)
# The CacheConfig fields cache_config_info carries: its flags (host_available_memory is a
# start-up measurement, not configuration).
_CACHE_INFO_FIELDS = tuple(f.name for f in dataclasses.fields(CacheConfig)
                           if f.name != "host_available_memory")


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
    """Args:
        model_name: the ``model_name`` label (the first served name).
        num_engines: data-parallel ranks; each one's series exist from the start.
        max_model_len: the top of the request-size histograms' buckets.
        cache_config: exported as ``widellm:cache_config_info`` when given.
        request_histograms: see :class:`RequestMetrics` (benchmarks only).
    """

    def __init__(self, model_name: str, num_engines: int, max_model_len: int,
                 cache_config: CacheConfig | None = None, request_histograms: bool = True) -> None:
        self.registry = r = CollectorRegistry()
        # prometheus_client's process_*, python_info and python_gc_* collectors, which it
        # registers on its global registry; /metrics serves this one only.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self._labels = {"model_name": model_name}
        names = ["model_name", "engine"]

        def per_engine(metric) -> PerEngine:
            return PerEngine(metric, self._labels, num_engines)

        self.num_requests_running = per_engine(Gauge(
            "widellm:num_requests_running", "Requests in the running batch", names, registry=r))
        self.num_requests_waiting = per_engine(Gauge(
            "widellm:num_requests_waiting", "Requests waiting to be scheduled", names,
            registry=r))
        self.kv_cache_usage_perc = per_engine(Gauge(
            "widellm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", names,
            registry=r))
        self.prefix_cache_queries = per_engine(Counter(
            "widellm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", names,
            registry=r))
        self.prefix_cache_hits = per_engine(Counter(
            "widellm:prefix_cache_hits", "Prompt tokens found in the prefix cache", names,
            registry=r))
        self.num_preemptions = per_engine(Counter(
            "widellm:num_preemptions", "Requests preempted for lack of KV blocks", names,
            registry=r))
        self.request_stalls = per_engine(Counter(
            "widellm:request_stalls", "Requests that went --request-stall-timeout-s without a "
            "token (engine: the one serving them, 'none' if not routed)", names, registry=r))
        self.requests = RequestMetrics(r, self._labels, num_engines, max_model_len,
                                       request_histograms)
        self.wide_ep = WideEPMetrics(r, self._labels, num_engines)
        self.kv_transfer = KVTransferMetrics(r, self._labels)
        self._cache_config = cache_config
        self._cache_config_info = Gauge(
            "widellm:cache_config_info", "The KV cache configuration (value 1; num_kv_blocks: "
            "the blocks of this engine's pool)", ["model_name", "engine", *_CACHE_INFO_FIELDS],
            registry=r)
        # Latest stats of each rank; the core reports running totals.
        self._last_core: dict[int, SchedulerStats] = {}
        self._last_log = time.monotonic()
        self._tokens_since_log = [0, 0]  # prompt, generation

    @classmethod
    def for_config(cls, config: EngineConfig, **kwargs) -> "EngineMetrics":
        return cls(config.model_config.served_name, config.parallel_config.data_parallel_size,
                   config.scheduler_config.max_model_len, config.cache_config, **kwargs)

    def record_kv_blocks(self, num_blocks_by_engine: dict[int, int]) -> None:
        """Export ``cache_config_info`` once the engines report their pools' sizes."""
        if self._cache_config is None:
            return
        info = {name: str(getattr(self._cache_config, name)) for name in _CACHE_INFO_FIELDS}
        for engine, num_blocks in sorted(num_blocks_by_engine.items()):
            self._cache_config_info.labels(
                **self._labels, engine=str(engine), **{**info, "num_kv_blocks": str(num_blocks)}
            ).set(1)

    def record_scheduler_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        self.num_requests_running[engine].set(stats.num_running_reqs)
        self.num_requests_waiting[engine].set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc[engine].set(stats.kv_cache_usage)
        last = self._last_core.get(engine, _ZERO_STATS)
        # The core reports running totals; counters advance by the difference.
        s, e = stats, engine
        self.prefix_cache_queries[e].inc(s.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_cache_hits[e].inc(s.prefix_cache_hits - last.prefix_cache_hits)
        self.num_preemptions[e].inc(s.num_preemptions - last.num_preemptions)
        self.wide_ep.record_scheduler_stats(stats, last, engine)
        if stats.kv_transfer is not None:
            self.kv_transfer.record(stats.kv_transfer, engine)
        self._last_core[engine] = stats

    def record_eplb(self, stats: EplbStats, engine: int = 0) -> None:
        self.wide_ep.record_eplb(stats, engine)

    def record_step_breakdown(self, totals: dict[str, float], engine: int) -> None:
        self.wide_ep.record_step_breakdown(totals, engine)

    def record_iteration(self, iteration: IterationStats) -> None:
        """One engine output batch's request-level numbers (``OutputProcessor``)."""
        self.requests.record_iteration(iteration)
        self._tokens_since_log[0] += iteration.num_prompt_tokens
        self._tokens_since_log[1] += iteration.num_generation_tokens

    def record_aborted(self, engine: int | None, num_sequences: int = 1) -> None:
        """A request ended by its client (disconnect, cancel) before it finished: its
        unfinished sequences count as ``request_success{finished_reason="abort"}``."""
        self.requests.record_aborted(engine, num_sequences)

    def record_stall(self, engine: int | None) -> None:
        if engine is None:
            self.request_stalls.metric.labels(**self._labels, engine=NO_ENGINE).inc()
        else:
            self.request_stalls[engine].inc()

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
