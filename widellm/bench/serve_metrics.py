"""Metric math for ``widellm bench serve``: pure functions over per-request records, with
the definitions of ``vllm bench serve`` (vllm/benchmarks/serve.py, ``calculate_metrics``):
TPOT excludes the first token, ITL pools every gap of every request, standard deviations are
population ones, empty samples report 0, goodput counts requests within every SLO.

Times in records are seconds from ``time.perf_counter``; reported latencies are milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MS_PER_S = 1000.0
# Metrics with latency statistics, in report order: (key, short name, section title).
LATENCY_METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
# Request-level metrics a goodput SLO may bound.
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What one benchmark request did, as measured by the client.

    Attributes:
        prompt_len: prompt tokens (from the server's usage chunk when it sent one).
        start_time: when the request was sent.
        ttft: seconds from ``start_time`` to the first content chunk (0 if none arrived).
        itl: seconds between consecutive content chunks after the first.
        latency: seconds from ``start_time`` to the end of the stream (end-to-end).
        output_tokens: generated tokens (usage chunk when present, else content chunks).
        usage_reported: ``output_tokens`` came from the server's usage chunk.
        generated_text: the text the server streamed.
        queue_time: seconds the request waited for a ``--max-concurrency`` slot.
        success: the stream completed with at least one content chunk.
        error: why it failed, empty on success.
    """

    prompt_len: int
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    usage_reported: bool = False
    generated_text: str = ""
    queue_time: float = 0.0
    success: bool = False
    error: str = ""


def percentile_label(p: float) -> str:
    """How a percentile is spelled in result keys, as in vLLM: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(p)) if int(p) == p else str(p)


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median, standard deviation and chosen percentiles of one latency metric, ms."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: tuple[tuple[float, float], ...]

    @classmethod
    def from_seconds(cls, samples: list[float], percentiles: tuple[float, ...]) -> LatencyStats:
        """Statistics of ``samples`` (seconds); all zero for no samples, so a run where every
        request failed still reports."""
        ms = np.asarray(samples or [0.0], dtype=np.float64) * MS_PER_S
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   tuple((p, float(np.percentile(ms, p))) for p in percentiles))


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The summary of a run: counts, throughputs and latency statistics.

    ``output_lens`` has one entry per request (0 for a failed one); ``request_goodput`` is
    None when no SLO was given.
    """

    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    output_lens: list[int]


def time_per_output_token(record: RequestRecord) -> float | None:
    """Mean seconds between output tokens after the first: (e2e - ttft) / (tokens - 1).

    None when the request produced fewer than two tokens, where TPOT is undefined.
    """
    if record.output_tokens < 2:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def count_good(records: list[RequestRecord], slos_ms: dict[str, float]) -> int:
    """Successful requests whose every SLO-bounded metric is at most its bound (ms); a
    request of one token meets any TPOT bound, as in vLLM."""
    def value_s(r: RequestRecord, metric: str) -> float:
        if metric == "tpot":
            return time_per_output_token(r) or 0.0
        return r.ttft if metric == "ttft" else r.latency

    return sum(all(value_s(r, m) <= bound / MS_PER_S for m, bound in slos_ms.items())
               for r in records if r.success)


def peak_output_and_concurrency(records: list[RequestRecord]) -> tuple[float, int]:
    """The most content chunks that arrived within one whole second of the run (counted
    from the first send), and the most requests in flight at one instant."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency for r in ok)
    per_second = np.zeros(int(np.ceil(end - t0)) + 1)
    for r in ok:
        arrivals = r.start_time + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl)))
        np.add.at(per_second, (arrivals - t0).astype(int).clip(0, len(per_second) - 1), 1)
    # Half-open [start, end): at a tie the request that ends leaves before one that starts.
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1)
                                                       for r in ok])
    peak = in_flight = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    return float(per_second.max()), peak


def compute_metrics(
    records: list[RequestRecord], duration: float, percentiles: tuple[float, ...] = (99.0,),
    goodput_slos_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    """Summarise ``records`` of a run that took ``duration`` seconds of wall time.

    Only successful requests count towards tokens, throughput and latencies; failures are
    counted and otherwise ignored.
    """
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in map(time_per_output_token, ok) if t is not None]
    peak_tokens, peak_requests = peak_output_and_concurrency(records)

    def stats(samples: list[float]) -> LatencyStats:
        return LatencyStats.from_seconds(samples, tuple(percentiles))

    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration,
        request_goodput=(count_good(records, goodput_slos_ms) / duration
                         if goodput_slos_ms else None),
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_requests,
        ttft=stats([r.ttft for r in ok]),
        tpot=stats(tpots),
        itl=stats([gap for r in ok for gap in r.itl]),
        e2el=stats([r.latency for r in ok]),
        output_lens=[r.output_tokens if r.success else 0 for r in records],
    )


def latency_dict(metrics: BenchmarkMetrics, selected: tuple[str, ...]) -> dict[str, float]:
    """``{mean,median,std,pXX}_{metric}_ms`` for each ``selected`` metric, as in vLLM's
    result files (e.g. ``median_ttft_ms``, ``p99_itl_ms``)."""
    out: dict[str, float] = {}
    for name in selected:
        stats: LatencyStats = getattr(metrics, name)
        out[f"mean_{name}_ms"] = stats.mean_ms
        out[f"median_{name}_ms"] = stats.median_ms
        out[f"std_{name}_ms"] = stats.std_ms
        for p, value in stats.percentiles_ms:
            out[f"p{percentile_label(p)}_{name}_ms"] = value
    return out


_TABLE_WIDTH = 52
_LABEL_WIDTH = 40


def format_summary(metrics: BenchmarkMetrics, selected: tuple[str, ...] = ("ttft", "tpot", "itl"),
                   max_concurrency: int | None = None, request_rate: float = float("inf"),
                   title: str = "Serving Benchmark Result") -> str:
    """A fixed-width text table of ``metrics`` for the terminal, with vLLM's rows."""
    rows: list[tuple[str, str]] = [
        ("Successful requests", f"{metrics.completed:d}"),
        ("Failed requests", f"{metrics.failed:d}"),
    ]
    if max_concurrency is not None:
        rows.append(("Maximum request concurrency", f"{max_concurrency:d}"))
    if request_rate != float("inf"):
        rows.append(("Request rate configured (RPS)", f"{request_rate:.2f}"))
    rows += [
        ("Benchmark duration (s)", f"{metrics.duration:.2f}"),
        ("Total input tokens", f"{metrics.total_input_tokens:d}"),
        ("Total generated tokens", f"{metrics.total_output_tokens:d}"),
        ("Request throughput (req/s)", f"{metrics.request_throughput:.2f}"),
    ]
    if metrics.request_goodput is not None:
        rows.append(("Request goodput (req/s)", f"{metrics.request_goodput:.2f}"))
    rows += [
        ("Output token throughput (tok/s)", f"{metrics.output_throughput:.2f}"),
        ("Peak output token throughput (tok/s)", f"{metrics.max_output_tokens_per_s:.2f}"),
        ("Peak concurrent requests", f"{metrics.max_concurrent_requests:d}"),
        ("Total token throughput (tok/s)", f"{metrics.total_token_throughput:.2f}"),
    ]
    lines = [f" {title} ".center(_TABLE_WIDTH, "=")]
    lines += [f"{label + ':':<{_LABEL_WIDTH}}{value:>12}" for label, value in rows]
    for name, short, long in LATENCY_METRICS:
        if name not in selected:
            continue
        stats: LatencyStats = getattr(metrics, name)
        lines.append(f" {long} ".center(_TABLE_WIDTH, "-"))
        values = [("Mean", stats.mean_ms), ("Median", stats.median_ms), ("Std", stats.std_ms)]
        values += [(f"P{percentile_label(p)}", v) for p, v in stats.percentiles_ms]
        lines += [f"{f'{label} {short} (ms):':<{_LABEL_WIDTH}}{v:>12.2f}" for label, v in values]
    lines.append("=" * _TABLE_WIDTH)
    return "\n".join(lines)
