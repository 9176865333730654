"""The simulator's report on a hand-built result: every number worked out by hand."""

from __future__ import annotations

import json

import pytest

from widellm.sim.report import format_table, timeseries, to_json, write_plots
from widellm.sim.types import RankStepCost, RequestRecord, SimResult, StepRecord

PNG_MAGIC = b"\x89PNG"


def _result() -> SimResult:
    requests = [
        # id, rank, arrival, prompt, output, first token, finish
        RequestRecord("0", 0, 0.0, 10, 11, 0.1, 1.1),  # TTFT 100, E2E 1100, ITL 100 ms
        RequestRecord("1", 1, 0.5, 20, 5, 0.8, 2.0),  # TTFT 300, E2E 1500, ITL 300 ms
        RequestRecord("2", 0, 1.0, 30, 1, 1.2, 1.2),  # TTFT 200, E2E 200, no ITL
        RequestRecord("3", 1, 1.5, 40, 0, None, None),  # never finished: not counted
    ]
    steps = [
        StepRecord("colocated", 0.0, 0.5, False, (4, 4), (
            RankStepCost(0.5, {"attention": 0.2, "expert_gemm": 0.1}),
            RankStepCost(0.5, {"attention": 0.1, "expert_gemm": 0.3}),
        ), 0.8),
        StepRecord("colocated", 0.5, 1.0, True, (2, 2), (
            RankStepCost(1.0, {"attention": 0.4}),
            RankStepCost(1.0, {"attention": 0.2, "dispatch": 0.6}),
        ), 0.6),
    ]
    # Output batches as they reached the frontend (17 tokens: the requests' 11 + 5 + 1).
    events = [(0.1, 1), (0.6, 4), (0.8, 1), (1.1, 6), (1.2, 1), (1.6, 2), (2.0, 2)]
    return SimResult(requests=requests, steps=steps, num_gpus=2, config={"model": "x"},
                     sim_wall_s=0.25, output_events=events)


def test_counts_and_throughput():
    s = to_json(_result())
    assert (s["num_requests"], s["num_finished"], s["num_gpus"]) == (4, 3, 2)
    assert (s["prompt_tokens"], s["output_tokens"]) == (60, 17)
    assert s["duration_s"] == pytest.approx(2.0)  # first arrival 0 -> last finish 2.0
    assert s["output_throughput"] == pytest.approx(8.5)
    assert s["output_throughput_per_gpu"] == pytest.approx(4.25)
    assert s["total_throughput_per_gpu"] == pytest.approx(77 / 2 / 2)
    assert s["request_throughput"] == pytest.approx(1.5)


def test_latency_percentiles():
    s = to_json(_result())
    # numpy's linear interpolation: p90 of [100, 200, 300] sits at index 1.8 -> 280.
    assert s["ttft_ms"] == pytest.approx({"mean": 200, "median": 200, "p90": 280, "p99": 298})
    assert s["e2e_ms"] == pytest.approx({"mean": 2800 / 3, "median": 1100, "p90": 1420,
                                         "p99": 1492})
    assert s["itl_ms"] == pytest.approx({"mean": 200, "median": 200, "p90": 280, "p99": 298})


def test_balancedness_and_step_breakdown():
    s = to_json(_result())
    assert s["balancedness"]["colocated"] == pytest.approx(
        {"mean": 0.7, "min": 0.6, "num_steps": 2})
    b = s["step_breakdown"]["colocated"]
    assert (b["num_steps"], b["mean_step_s"], b["dbo_fraction"]) == pytest.approx((2, 0.75, 0.5))
    phases = b["phases"]
    assert list(phases) == ["attention", "dispatch", "expert_gemm", "total"]
    assert phases["attention"]["per_rank"] == pytest.approx([0.3, 0.15])
    assert (phases["attention"]["rank_max"], phases["attention"]["rank_mean"]) == \
        pytest.approx((0.3, 0.225))
    assert (phases["expert_gemm"]["rank_max"], phases["expert_gemm"]["rank_mean"]) == \
        pytest.approx((0.15, 0.1))
    assert (phases["dispatch"]["rank_max"], phases["dispatch"]["rank_mean"]) == \
        pytest.approx((0.3, 0.15))
    assert phases["total"]["per_rank"] == pytest.approx([0.75, 0.75])


def test_throughput_and_balancedness_over_time():
    series = timeseries(_result(), num_windows=4)
    assert series["edges_s"] == pytest.approx([0, 0.5, 1.0, 1.5, 2.0])
    # Tokens per window (0, 0.5], (0.5, 1.0], (1.0, 1.5], (1.5, 2.0]: 1, 4 + 1, 6 + 1, 2 + 2;
    # window tokens / 0.5 s / 2 GPUs = tokens.
    assert series["output_throughput_per_gpu"] == pytest.approx([1.0, 5.0, 7.0, 4.0])
    assert sum(series["output_throughput_per_gpu"]) == pytest.approx(17)
    assert series["balancedness"]["colocated"] == {"mean": [0.8, 0.6, None, None],
                                                   "min": [0.8, 0.6, None, None]}


def test_decode_gpus_and_the_median_window():
    colocated = to_json(_result(), num_windows=4)
    # Windows of 1, 5, 7, 4 tok/s per GPU (above): the median is (4 + 5) / 2.
    assert colocated["median_window_output_throughput_per_gpu"] == pytest.approx(4.5)
    assert colocated["decode_gpus"] == 2  # colocated: every GPU produces output
    assert colocated["output_throughput_per_decode_gpu"] == pytest.approx(4.25)
    assert colocated["median_window_output_throughput_per_decode_gpu"] == pytest.approx(4.5)
    # The same run as a disaggregated deployment with one of its two GPUs decoding.
    result = _result()
    result.config = {"prefill": {"num_ranks": 1}, "decode": {"num_ranks": 1}}
    disagg = to_json(result, num_windows=4)
    assert (disagg["decode_gpus"], disagg["output_throughput_per_gpu"]) == (1, 4.25)
    assert disagg["output_throughput_per_decode_gpu"] == pytest.approx(8.5)
    assert disagg["median_window_output_throughput_per_decode_gpu"] == pytest.approx(9.0)
    steady = next(line for line in format_table(disagg).splitlines()
                  if line.startswith("steady"))
    assert steady == ("steady        4.5 output tok/s/GPU in the median window; per decode GPU "
                      "(1): 8.5 over the run, 9.0 in the median window")


def test_json_round_trips_and_table_shows_the_numbers():
    s = to_json(_result())
    assert json.loads(json.dumps(s)) == s
    table = format_table(s)
    assert "3 / 4 finished on 2 GPUs" in table
    assert "4.2 output tok/s/GPU" in table  # 4.25 at one decimal
    ttft = next(line for line in table.splitlines() if line.startswith("TTFT"))
    assert ttft.split() == ["TTFT", "200.00", "200.00", "280.00", "298.00"]
    total = next(line for line in table.splitlines() if line.startswith("total "))
    assert total.split() == ["total", "750.000", "750.000"]


def test_empty_result():
    empty = SimResult(requests=[], steps=[], num_gpus=4, config={})
    s = to_json(empty)
    assert (s["num_finished"], s["output_throughput_per_gpu"], s["ttft_ms"]["p99"]) == (0, 0.0,
                                                                                       None)
    assert "0 / 0 finished" in format_table(s)


def test_plots_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_plots(_result(), str(tmp_path / "plots"), num_windows=4)
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["balancedness.png", "latency.png",
                                                          "throughput.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(4) == PNG_MAGIC
