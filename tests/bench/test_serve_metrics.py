"""Metric math of ``widellm bench serve`` on hand-made request records."""

import pytest

from widellm.bench.serve_metrics import (
    LatencyStats,
    RequestRecord,
    compute_metrics,
    count_good,
    format_summary,
    latency_dict,
    peak_output_and_concurrency,
    percentile_label,
    time_per_output_token,
)

EXACT = 1e-12


def _ok(ttft: float, latency: float, output_tokens: int, itl=(), prompt_len: int = 10,
        start_time: float = 0.0):
    return RequestRecord(prompt_len=prompt_len, ttft=ttft, itl=list(itl), latency=latency,
                         output_tokens=output_tokens, success=True, start_time=start_time)


def test_latency_stats_are_exact_linear_percentiles_in_ms():
    stats = LatencyStats.from_seconds([0.4, 0.1, 0.3, 0.2], percentiles=(50, 90, 99))
    assert stats.mean_ms == pytest.approx(250.0, rel=EXACT)
    assert stats.median_ms == pytest.approx(250.0, rel=EXACT)
    # Population standard deviation (numpy's default, as vLLM): sqrt(mean of squared gaps).
    assert stats.std_ms == pytest.approx(12500 ** 0.5, rel=EXACT)
    # Linear interpolation between ranks: 100 + 0.9 * 3 * 100, 100 + 0.99 * 3 * 100.
    p = dict(stats.percentiles_ms)
    assert (p[50], p[90], p[99]) == pytest.approx((250.0, 370.0, 397.0), rel=EXACT)


def test_latency_stats_of_no_samples_are_zero():
    assert LatencyStats.from_seconds([], (99,)) == LatencyStats(0.0, 0.0, 0.0, ((99, 0.0),))


def test_percentile_labels_follow_vllm():
    assert [percentile_label(p) for p in (99.0, 50, 99.9, 25.5)] == ["99", "50", "99.9",
                                                                       "25.5"]


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
    m = compute_metrics(records, duration=2.0, percentiles=(90, 99))
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 29)
    assert m.output_lens == [10, 18, 1, 0]
    assert m.request_throughput == pytest.approx(1.5, rel=EXACT)
    assert m.request_goodput is None  # no SLO given
    assert m.output_throughput == pytest.approx(14.5, rel=EXACT)
    assert m.total_token_throughput == pytest.approx(44.5, rel=EXACT)
    assert m.ttft.mean_ms == pytest.approx(200.0, rel=EXACT)
    assert m.ttft.median_ms == pytest.approx(200.0, rel=EXACT)
    # TPOT samples: (1.0 - 0.1) / 9 = 0.1 s and (2.0 - 0.3) / 17 = 0.1 s.
    assert m.tpot.mean_ms == pytest.approx(100.0, rel=EXACT)
    assert m.tpot.std_ms == pytest.approx(0.0, abs=1e-9)
    # ITL pools every gap of every request: 100, 200, 300 ms.
    assert m.itl.mean_ms == pytest.approx(200.0, rel=EXACT)
    assert dict(m.itl.percentiles_ms)[90] == pytest.approx(280.0, rel=EXACT)
    assert m.e2el.median_ms == pytest.approx(1000.0, rel=EXACT)
    assert dict(m.e2el.percentiles_ms)[90] == pytest.approx(1800.0, rel=EXACT)


def test_goodput_counts_requests_within_every_slo():
    records = [
        _ok(ttft=0.1, latency=1.0, output_tokens=10),   # TPOT 100 ms
        _ok(ttft=0.6, latency=1.5, output_tokens=10),   # TTFT too slow
        _ok(ttft=0.1, latency=2.8, output_tokens=10),   # TPOT 300 ms: too slow
        _ok(ttft=0.2, latency=0.2, output_tokens=1),    # one token: meets any TPOT bound
        RequestRecord(prompt_len=5, error="x"),
    ]
    assert count_good(records, {"ttft": 500, "tpot": 150}) == 2
    assert count_good(records, {"e2el": 1500}) == 3  # bounds are inclusive
    m = compute_metrics(records, duration=4.0, goodput_slos_ms={"ttft": 500, "tpot": 150})
    assert m.request_goodput == pytest.approx(0.5, rel=EXACT)


def test_peak_output_per_second_and_concurrency():
    records = [
        # Chunks at 0.1, 0.2, 0.3 and 1.2 s after the first send.
        _ok(ttft=0.1, latency=1.3, output_tokens=4, itl=[0.1, 0.1, 0.9], start_time=10.0),
        # Starts after the first ends.
        _ok(ttft=0.5, latency=1.0, output_tokens=1, start_time=11.5),
        _ok(ttft=0.05, latency=0.2, output_tokens=2, itl=[0.05], start_time=10.5),
        RequestRecord(prompt_len=5, error="x", start_time=10.0, latency=50.0),
    ]
    tokens, concurrency = peak_output_and_concurrency(records)
    # Second 0 holds three chunks of the first request and both of the third's.
    assert tokens == 5.0
    assert concurrency == 2
    assert peak_output_and_concurrency([RequestRecord(prompt_len=1)]) == (0.0, 0)
    # One ends at the instant the next starts: never two in flight.
    back_to_back = [_ok(ttft=0.0, latency=0.25, output_tokens=1, start_time=0.5),
                    _ok(ttft=0.0, latency=0.25, output_tokens=1, start_time=0.75)]
    assert peak_output_and_concurrency(back_to_back) == (2.0, 1)


def test_all_failed_run_reports_zeros():
    m = compute_metrics([RequestRecord(prompt_len=5, error="x")] * 3, duration=1.0)
    assert (m.completed, m.failed, m.total_output_tokens) == (0, 3, 0)
    assert m.request_throughput == 0.0
    assert m.ttft == m.e2el == LatencyStats(0.0, 0.0, 0.0, ((99.0, 0.0),))
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (0.0, 0)


def test_non_positive_duration_is_rejected():
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([], duration=0.0)


def test_latency_dict_and_summary_table():
    m = compute_metrics([_ok(ttft=0.5, latency=1.5, output_tokens=11)], duration=4.0,
                        percentiles=(50, 99.9), goodput_slos_ms={"ttft": 100})
    d = latency_dict(m, ("ttft", "tpot", "e2el"))
    assert d["median_ttft_ms"] == 500.0 and d["std_ttft_ms"] == 0.0
    assert d["p99.9_tpot_ms"] == pytest.approx(100.0, rel=EXACT)
    assert d["mean_e2el_ms"] == 1500.0
    assert set(d) == {f"{s}_{n}_ms" for s in ("mean", "median", "std", "p50", "p99.9")
                      for n in ("ttft", "tpot", "e2el")}
    lines = format_summary(m, ("ttft", "e2el"), max_concurrency=8, request_rate=2.0)
    lines = lines.splitlines()
    assert "Successful requests:" in lines[1] and lines[1].endswith(" 1")
    assert any(line.startswith("Median TTFT (ms):") and line.endswith("500.00")
               for line in lines)
    assert any(line.startswith("P99.9 E2EL (ms):") for line in lines)
    assert not any("TPOT" in line or "ITL" in line for line in lines)
    assert any(line.startswith("Request goodput (req/s):") and line.endswith("0.00")
               for line in lines)
    assert any(line.startswith("Maximum request concurrency:") and line.endswith(" 8")
               for line in lines)
    assert any(line.startswith("Request throughput (req/s):") and line.endswith("0.25")
               for line in lines)
