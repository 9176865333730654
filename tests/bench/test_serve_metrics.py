"""Metric math of ``widellm bench serve`` on hand-made request records."""

import pytest

from widellm.bench.serve_metrics import (
    LatencyStats,
    RequestRecord,
    compute_metrics,
    format_summary,
    metrics_to_dict,
    time_per_output_token,
)

EXACT = 1e-12


def _ok(ttft: float, latency: float, output_tokens: int, itl=(), prompt_len: int = 10):
    return RequestRecord(prompt_len=prompt_len, ttft=ttft, itl=list(itl), latency=latency,
                         output_tokens=output_tokens, success=True)


def test_latency_stats_are_exact_linear_percentiles_in_ms():
    stats = LatencyStats.from_seconds([0.4, 0.1, 0.3, 0.2])
    assert stats.mean_ms == pytest.approx(250.0, rel=EXACT)
    assert stats.median_ms == pytest.approx(250.0, rel=EXACT)
    # Linear interpolation between ranks: 100 + 0.9 * 3 * 100, 100 + 0.99 * 3 * 100.
    assert stats.p90_ms == pytest.approx(370.0, rel=EXACT)
    assert stats.p99_ms == pytest.approx(397.0, rel=EXACT)


def test_latency_stats_of_no_samples_are_zero():
    assert LatencyStats.from_seconds([]) == LatencyStats(0.0, 0.0, 0.0, 0.0)


def test_tpot_excludes_the_first_token():
    assert time_per_output_token(_ok(ttft=0.1, latency=1.0, output_tokens=10)) == (
        pytest.approx(0.1, rel=EXACT))
    assert time_per_output_token(_ok(ttft=0.1, latency=1.0, output_tokens=1)) is None


def test_compute_metrics_counts_throughput_and_latencies():
    records = [
        _ok(ttft=0.1, latency=1.0, output_tokens=10, itl=[0.1, 0.2], prompt_len=20),
        _ok(ttft=0.3, latency=2.0, output_tokens=18, itl=[0.3], prompt_len=30),
        # TPOT is undefined for one token; it still counts everywhere else.
        _ok(ttft=0.2, latency=0.2, output_tokens=1, prompt_len=10),
        RequestRecord(prompt_len=99, output_tokens=50, error="HTTP 400: bad"),
    ]
    m = compute_metrics(records, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 29)
    assert m.request_throughput == pytest.approx(1.5, rel=EXACT)
    assert m.output_throughput == pytest.approx(14.5, rel=EXACT)
    assert m.total_token_throughput == pytest.approx(44.5, rel=EXACT)
    assert m.ttft.mean_ms == pytest.approx(200.0, rel=EXACT)
    assert m.ttft.median_ms == pytest.approx(200.0, rel=EXACT)
    # TPOT samples: (1.0 - 0.1) / 9 = 0.1 s and (2.0 - 0.3) / 17 = 0.1 s.
    assert m.tpot.mean_ms == pytest.approx(100.0, rel=EXACT)
    assert m.tpot.p99_ms == pytest.approx(100.0, rel=EXACT)
    # ITL pools every gap of every request: 100, 200, 300 ms.
    assert m.itl.mean_ms == pytest.approx(200.0, rel=EXACT)
    assert m.itl.p90_ms == pytest.approx(280.0, rel=EXACT)
    assert m.e2el.median_ms == pytest.approx(1000.0, rel=EXACT)
    assert m.e2el.p90_ms == pytest.approx(1800.0, rel=EXACT)


def test_all_failed_run_reports_zeros():
    m = compute_metrics([RequestRecord(prompt_len=5, error="x")] * 3, duration_s=1.0)
    assert (m.completed, m.failed, m.total_output_tokens) == (0, 3, 0)
    assert m.request_throughput == 0.0
    assert m.ttft == m.e2el == LatencyStats(0.0, 0.0, 0.0, 0.0)


def test_non_positive_duration_is_rejected():
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([], duration_s=0.0)


def test_metrics_dict_and_summary_table():
    m = compute_metrics([_ok(ttft=0.5, latency=1.5, output_tokens=11)], duration_s=4.0)
    d = metrics_to_dict(m)
    assert d["completed"] == 1 and d["failed"] == 0
    assert d["request_throughput"] == 0.25
    assert d["median_ttft_ms"] == 500.0
    assert d["p99_tpot_ms"] == pytest.approx(100.0, rel=EXACT)
    assert d["mean_e2el_ms"] == 1500.0
    latency_keys = {k for k in d if k.endswith("_ms")}
    assert latency_keys == {f"{s}_{n}_ms" for s in ("mean", "median", "p90", "p99")
                            for n in ("ttft", "tpot", "itl", "e2el")}
    lines = format_summary(m).splitlines()
    assert "Successful requests:" in lines[1] and lines[1].endswith(" 1")
    assert any(line.startswith("Median TTFT (ms):") and line.endswith("500.00")
               for line in lines)
    assert any(line.startswith("Request throughput (req/s):") and line.endswith("0.25")
               for line in lines)
