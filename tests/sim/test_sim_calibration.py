"""Issue 26's calibration on the machine that runs the suite: the simulator with a CPU profile
measured here predicts the real engine's offline output tok/s and mean step time on
preset:deepseek-v3-small, on one rank and on two expert-parallel ranks.

The profile is measured in this test (micro-benchmarks of the matmul peak, the copy bandwidth,
widellm's linear and expert kernels on all threads and on one thread next to a busy neighbour,
gloo all-to-alls idle and between busy ranks); the only number taken from the engine is the
host time per step and per sequence, the least-squares line over probes of 1, 8, 16 and 24
sequences decoding short prompts, none of them a compared case (``widellm/sim/calibration.py``).
Both sides run in this one test, and both take the fastest of repeated timings: the profile's
of many calls, the engine's of two runs of each probe and case (one disturbed probe used to
skew the fitted host time and with it every prediction: 0 + 16 ms per sequence once, against
the usual ~2 + 6).

The issue's bound is 15%. One run of each side moves by about 10% here (machine noise, on both
sides), so a single run is asserted within 25%, and the 15% is judged on the medians of
repeated rounds: ``benchmarks/sim_calibration.py``, results in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import warnings

import pytest

from widellm.sim.calibration import (
    PROBE_SIZES, CalibrationCase, EngineSettings, calibrate_in_fresh_process, host_time_line,
)

SINGLE_RUN_TOLERANCE = 0.25
# Small enough for the suite; decode-dominated like the benchmark (docs/BENCHMARKS.md has the
# 32 x 64 / 64 figures).
CASES = [CalibrationCase("dp1", 1, 16, 32, 32), CalibrationCase("dp2-ep2", 2, 16, 32, 32)]


ROUNDS = 2  # a second round only when the first is outside the bound
ROUND_TIMEOUT_S = 400  # two rounds within the test's own timeout


def _round() -> tuple[bool, str]:
    # Engine limits sized to the workload: less start-up warm-up, same steps.
    # max_num_seqs: the largest probe's batch (the cases' 16 prompts fit either way).
    settings = EngineSettings("preset:deepseek-v3-small", num_kv_blocks=512,
                              max_num_seqs=max(PROBE_SIZES), max_num_batched_tokens=512)
    # In a fresh process: in this one, after the rest of the suite, the one-rank engine ran
    # ~50% slower than alone (351 against ~235 ms per step) while the profile's kernels did not.
    result = calibrate_in_fresh_process(settings, CASES, timeout_s=ROUND_TIMEOUT_S)
    fitted, rows = result.profile, result.rows
    table = "\n".join(
        f"{r.case.name}: tok/s real {r.real.output_tok_s:.1f} sim {r.simulated.output_tok_s:.1f}"
        f" ({r.throughput_error:+.1%}); step ms real {r.real.mean_step_s * 1e3:.1f} sim "
        f"{r.simulated.mean_step_s * 1e3:.1f} ({r.step_time_error:+.1%})" for r in rows)
    table += (f"\nhost time per step (probes): {fitted.step_overhead_s * 1e3:.1f} ms + "
              f"{fitted.step_overhead_per_seq_s * 1e3:.2f} ms per sequence")
    for row in rows:
        # Both sides ran the same requests to the end in the same steps (give or take the one
        # a DP > 1 client's step count, which comes with outputs, may lag by).
        assert abs(row.simulated.num_steps - row.real.num_steps) <= 1, table
    # The probes always cost some host time here; a fit of none means they were disturbed
    # (seen once, in a round whose DP2 run was also 30% slow), which the second round retries.
    fit_found = fitted.step_overhead_s + fitted.step_overhead_per_seq_s > 0
    within = fit_found and all(abs(r.throughput_error) <= SINGLE_RUN_TOLERANCE
                               and abs(r.step_time_error) <= SINGLE_RUN_TOLERANCE for r in rows)
    return within, table


@pytest.mark.timeout(900)
def test_simulator_predicts_the_engine_on_this_machine():
    """One round within the bound passes; a first round outside it (a disturbed profile or
    engine run: seen in clean-clone suite runs, +29% on DP1's step time once, a host-time fit
    of zero and DP2 +31% another time) gets a second."""
    tables = []
    for _ in range(ROUNDS):
        within, table = _round()
        tables.append(table)
        if within:
            print(table)
            if len(tables) > 1:  # shown in the run's warnings summary, so CI logs keep it
                warnings.warn("calibration round(s) outside the bound before this one "
                              "passed:\n" + "\n--\n".join(tables[:-1]))
            return
    raise AssertionError("\n--\n".join(tables))


def test_probe_fit_recovers_a_known_host_time():
    """Probes that took exactly 10 ms per step + 0.5 ms per sequence longer than the bare
    simulation give back those two numbers, and the fitted profile then reproduces them."""
    from widellm.sim.calibration import (
        RunNumbers, fit_host_overhead, probe_case, simulate_case,
    )
    from widellm.sim.hardware import H100

    settings = EngineSettings("preset:deepseek-v3-tiny", num_kv_blocks=1024)
    probes = {}
    for seqs in PROBE_SIZES:
        bare = simulate_case(settings, H100, probe_case(seqs))
        probes[seqs] = RunNumbers(0.0, bare.mean_step_s + 0.010 + 0.0005 * seqs,
                                  bare.num_steps)
    fitted = fit_host_overhead(settings, H100, probes)
    assert fitted.step_overhead_s == pytest.approx(0.010)
    assert fitted.step_overhead_per_seq_s == pytest.approx(0.0005)
    largest = max(PROBE_SIZES)
    assert simulate_case(settings, fitted, probe_case(largest)).mean_step_s == pytest.approx(
        probes[largest].mean_step_s)


def test_host_time_line_averages_over_the_probes():
    """The least-squares line, by hand: residuals 20, 40, 50, 60 ms at 1, 8, 16, 24
    sequences have mean size 12.25 and mean 42.5 ms; the deviations' products sum to 497.5
    (ms) and the sizes' squared deviations to 296.75, so 1.6765 ms per sequence and
    42.5 - 12.25 * 1.6765 = 21.963 ms per step. A bump at one size moves the line by a
    share, not all of it: the two-point line through 1 and 8 read 2.857 ms per sequence."""
    per_step, per_seq = host_time_line([1, 8, 16, 24], [0.020, 0.040, 0.050, 0.060])
    assert per_seq == pytest.approx(0.0016765, abs=1e-7)
    assert per_step == pytest.approx(0.021963, abs=1e-6)
    assert host_time_line([1, 8], [0.020, 0.040]) == pytest.approx((0.020 - 0.020 / 7,
                                                                    0.020 / 7))


def test_host_time_line_keeps_both_parts_at_or_above_zero():
    """A residual falling with the batch is all per step (its mean); one whose line would
    cross zero above no sequences is all per sequence (the line through the origin); a
    single size cannot fit a line."""
    assert host_time_line([1, 8, 16], [0.030, 0.020, 0.010]) == pytest.approx((0.020, 0.0))
    # y = 0.002 * x - 0.004 exactly: the proportional fit is sum(xy) / sum(xx).
    sizes, residuals = [4, 8, 16], [0.004, 0.012, 0.028]
    expected = sum(x * y for x, y in zip(sizes, residuals)) / sum(x * x for x in sizes)
    assert host_time_line(sizes, residuals) == pytest.approx((0.0, expected))
    assert host_time_line([1, 8], [-0.010, -0.005]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="two sizes"):
        host_time_line([8, 8], [0.010, 0.020])
