"""Metric math for ``widellm bench serve``: pure functions over per-request records.

Times in records are seconds from ``time.perf_counter``; reported latencies are milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MS_PER_S = 1000.0
# Percentiles every latency metric reports, besides the mean and the median.
REPORTED_PERCENTILES = (90, 99)


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
        success: the stream completed with at least one content chunk.
        error: why it failed, empty on success.
    """

    prompt_len: int
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    success: bool = False
    error: str = ""


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median and tail percentiles of one latency metric, in milliseconds."""

    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def from_seconds(cls, samples: list[float]) -> LatencyStats:
        """Statistics of ``samples`` (seconds); all zero for no samples, so a run where every
        request failed still reports."""
        if not samples:
            return cls(0.0, 0.0, 0.0, 0.0)
        ms = np.asarray(samples, dtype=np.float64) * MS_PER_S
        p90, p99 = np.percentile(ms, REPORTED_PERCENTILES)
        return cls(float(ms.mean()), float(np.median(ms)), float(p90), float(p99))


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The summary of a run: counts, throughputs and latency statistics."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats


def time_per_output_token(record: RequestRecord) -> float | None:
    """Mean seconds between output tokens after the first: (e2e - ttft) / (tokens - 1).

    None when the request produced fewer than two tokens, where TPOT is undefined.
    """
    if record.output_tokens < 2:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def compute_metrics(records: list[RequestRecord], duration_s: float) -> BenchmarkMetrics:
    """Summarise ``records`` of a run that took ``duration_s`` seconds of wall time.

    Only successful requests count towards tokens, throughput and latencies; failures are
    counted and otherwise ignored.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in map(time_per_output_token, ok) if t is not None]
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft=LatencyStats.from_seconds([r.ttft for r in ok]),
        tpot=LatencyStats.from_seconds(tpots),
        itl=LatencyStats.from_seconds([gap for r in ok for gap in r.itl]),
        e2el=LatencyStats.from_seconds([r.latency for r in ok]),
    )


def metrics_to_dict(metrics: BenchmarkMetrics) -> dict[str, float | int]:
    """A flat dict of ``metrics``; latency keys read ``{mean,median,p90,p99}_{metric}_ms``
    (e.g. ``median_ttft_ms``), as in vLLM's result files."""
    out: dict[str, float | int] = {}
    for name, value in vars(metrics).items():
        if isinstance(value, LatencyStats):
            for stat, ms in vars(value).items():
                out[f"{stat.removesuffix('_ms')}_{name}_ms"] = ms
        else:
            out[name] = value
    return out


# Rows of the printed summary: (label, BenchmarkMetrics attribute, format).
_COUNT_ROWS = (
    ("Successful requests", "completed", "{:d}"),
    ("Failed requests", "failed", "{:d}"),
    ("Benchmark duration (s)", "duration_s", "{:.2f}"),
    ("Total input tokens", "total_input_tokens", "{:d}"),
    ("Total generated tokens", "total_output_tokens", "{:d}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
)
_LATENCY_SECTIONS = (
    ("ttft", "TTFT", "Time to first token"),
    ("tpot", "TPOT", "Time per output token (excl. 1st)"),
    ("itl", "ITL", "Inter-token latency"),
    ("e2el", "E2EL", "End-to-end latency"),
)
_TABLE_WIDTH = 52
_LABEL_WIDTH = 40


def format_summary(metrics: BenchmarkMetrics, title: str = "Serving benchmark") -> str:
    """A fixed-width text table of ``metrics`` for the terminal."""
    lines = [f" {title} ".center(_TABLE_WIDTH, "=")]
    for label, attr, fmt in _COUNT_ROWS:
        lines.append(f"{label + ':':<{_LABEL_WIDTH}}{fmt.format(getattr(metrics, attr)):>12}")
    for attr, short, long in _LATENCY_SECTIONS:
        stats: LatencyStats = getattr(metrics, attr)
        lines.append(f" {long} ".center(_TABLE_WIDTH, "-"))
        for name, value in (("Mean", stats.mean_ms), ("Median", stats.median_ms),
                            ("P90", stats.p90_ms), ("P99", stats.p99_ms)):
            lines.append(f"{f'{name} {short} (ms):':<{_LABEL_WIDTH}}{value:>12.2f}")
    lines.append("=" * _TABLE_WIDTH)
    return "\n".join(lines)
