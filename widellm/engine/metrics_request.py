"""Per-request Prometheus metrics with vLLM's V1 names and meanings under ``widellm:``: token
counters, finish reasons, and the histograms of latencies, phase times and request sizes,
recorded from the frontend's :class:`IterationStats` (one per engine-core output batch).

Every series carries ``model_name`` and ``engine`` (the data-parallel rank that served the
request); each engine's series exist from the start, at zero, so a dashboard query returns
data before the first request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from widellm.engine.iteration_stats import IterationStats

# Bucket edges in seconds, from sub-frame decode gaps to multi-minute CPU prefills.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# Queue, prefill, decode and inference time of a request: a queue time is often a few
# milliseconds on an idle server and a CPU decode of a long answer takes minutes.
REQUEST_PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                         40.0, 80.0, 160.0, 320.0, 640.0)
# Tokens per output batch: powers of two up to the largest step budgets in use (vLLM's edges).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# The n request parameter (vLLM's edges).
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error")
# The engine label of an event no rank can be named for (a request aborted or stalled before
# it was routed).
NO_ENGINE = "none"


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: token counts of requests span four
    orders of magnitude, and the edges stay readable."""
    edges, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(edges)
            edges.append(m * scale)
        scale *= 10


class PerEngine:
    """One metric's child per engine, created up front (``children[engine]``)."""

    def __init__(self, metric, labels: dict[str, str], num_engines: int) -> None:
        self.metric, self.labels = metric, labels
        self.children = [metric.labels(**labels, engine=str(e)) for e in range(num_engines)]

    def __getitem__(self, engine: int):
        if 0 <= engine < len(self.children):
            return self.children[engine]
        return self.metric.labels(**self.labels, engine=str(engine))


class RequestMetrics:
    """Args:
        histograms: False leaves the request histograms of vLLM's V1 set (phase times, TPOT,
            request sizes and parameters, iteration tokens) at zero; only
            benchmarks/metrics_cost.sh sets it, to measure what they cost.
    """

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str], num_engines: int,
                 max_model_len: int, histograms: bool = True) -> None:
        self.histograms = histograms
        names = [*labels, "engine"]
        r = registry

        def per_engine(metric) -> PerEngine:
            return PerEngine(metric, labels, num_engines)

        def histogram(name: str, doc: str, buckets) -> PerEngine:
            return per_engine(Histogram(name, doc, names, buckets=buckets, registry=r))

        token_buckets = one_two_five_buckets(max_model_len)
        self._labels = labels
        self.prompt_tokens = per_engine(Counter(
            "widellm:prompt_tokens", "Prompt tokens processed, counted in the output batch "
            "that ends each request's prefill", names, registry=r))
        self.generation_tokens = per_engine(Counter(
            "widellm:generation_tokens", "Generated tokens", names, registry=r))
        success = Counter("widellm:request_success", "Finished requests by reason (abort: the "
                          "client went away or cancelled)", [*names, "finished_reason"],
                          registry=r)
        self.request_success = {
            reason: PerEngine(success, {**labels, "finished_reason": reason}, num_engines)
            for reason in FINISH_REASONS}
        self.iteration_tokens = histogram(
            "widellm:iteration_tokens_total", "Tokens per engine output batch: prompts whose "
            "prefill ended in it plus tokens generated in it", ITERATION_TOKENS_BUCKETS)
        self.time_to_first_token = histogram(
            "widellm:time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "widellm:inter_token_latency_seconds", "Time between a request's consecutive "
            "token batches (engine-core clock)", ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "widellm:e2e_request_latency_seconds", "Arrival to finish", E2E_BUCKETS)
        self.queue_time = histogram(
            "widellm:request_queue_time_seconds", "Time a request waited (engine core queued "
            "to first scheduled)", REQUEST_PHASE_BUCKETS)
        self.prefill_time = histogram(
            "widellm:request_prefill_time_seconds", "First scheduled to the end of the prefill "
            "(its first token)", REQUEST_PHASE_BUCKETS)
        self.decode_time = histogram(
            "widellm:request_decode_time_seconds", "First token to last token",
            REQUEST_PHASE_BUCKETS)
        self.inference_time = histogram(
            "widellm:request_inference_time_seconds", "First scheduled to last token (prefill "
            "+ decode, preemptions included)", REQUEST_PHASE_BUCKETS)
        self.time_per_output_token = histogram(
            "widellm:request_time_per_output_token_seconds", "A request's decode time over its "
            "tokens after the first (TPOT)", ITL_BUCKETS)
        self.prompt_tokens_request = histogram(
            "widellm:request_prompt_tokens", "Prompt tokens of a finished request", token_buckets)
        self.generation_tokens_request = histogram(
            "widellm:request_generation_tokens", "Tokens a finished request generated",
            token_buckets)
        self.max_tokens_request = histogram(
            "widellm:request_params_max_tokens", "The max_tokens parameter of a finished request",
            token_buckets)
        self.n_request = histogram(
            "widellm:request_params_n", "The n parameter of a finished request", N_BUCKETS)
        self.max_num_generation_tokens = histogram(
            "widellm:request_max_num_generation_tokens", "The longest of a finished request's n "
            "samples, in tokens", token_buckets)

    def record_iteration(self, it: IterationStats) -> None:
        e = it.engine
        if it.num_prompt_tokens:
            self.prompt_tokens[e].inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens[e].inc(it.num_generation_tokens)
        for ttft in it.time_to_first_tokens_s:
            self.time_to_first_token[e].observe(ttft)
        for itl in it.inter_token_latencies_s:
            self.inter_token_latency[e].observe(itl)
        for f in it.finished:
            self._success(f.finish_reason, e).inc()
            self.e2e_request_latency[e].observe(f.e2e_latency_s)
        if self.histograms:
            self._record_histograms(it)

    def _record_histograms(self, it: IterationStats) -> None:
        e = it.engine
        if it.num_prompt_tokens or it.num_generation_tokens:
            self.iteration_tokens[e].observe(it.num_prompt_tokens + it.num_generation_tokens)
        for f in it.finished:
            self.prompt_tokens_request[e].observe(f.num_prompt_tokens)
            self.generation_tokens_request[e].observe(f.num_generation_tokens)
            if f.max_tokens:
                self.max_tokens_request[e].observe(f.max_tokens)
            if f.queued_time_s is not None:
                self.queue_time[e].observe(f.queued_time_s)
                self.prefill_time[e].observe(f.prefill_time_s)
                self.decode_time[e].observe(f.decode_time_s)
                self.inference_time[e].observe(f.inference_time_s)
            if f.mean_time_per_output_token_s is not None:
                self.time_per_output_token[e].observe(f.mean_time_per_output_token_s)
        for n, longest in it.finished_parents:
            self.n_request[e].observe(n)
            self.max_num_generation_tokens[e].observe(longest)

    def record_aborted(self, engine: int | None, num_sequences: int) -> None:
        """``num_sequences`` sequences of one request ended by its client (disconnect,
        cancel) before they finished, on ``engine`` (None: not routed yet)."""
        self._success("abort", engine).inc(num_sequences)

    def _success(self, reason: str, engine: int | None):
        per_engine = self.request_success.get(reason)
        if per_engine is not None and engine is not None:
            return per_engine[engine]
        success = self.request_success["stop"].metric
        return success.labels(**self._labels, finished_reason=reason,
                              engine=NO_ENGINE if engine is None else str(engine))
