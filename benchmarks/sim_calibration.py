"""The simulator's calibration against the real engine on this machine (issue 26): per round,
measure the CPU profile, run each case on the engine (the probes first, which fit the
profile's host time per step; every engine number the fastest of ``--repeats`` runs),
simulate each case; print every round and the medians. ``--compare-probe-sizes`` also fits
the host time on a subset of the same probes and simulates the cases with that fit: two fits
side by side on one set of engine runs.

    .venv/bin/python benchmarks/sim_calibration.py [--rounds 3] [--num-prompts 32
        --input-len 64 --output-len 64] [--write-profile widellm/sim/profiles/cpu.json]
        [--ep-backends all2all,all2all_fixed] [--repeats 2] [--compare-probe-sizes 1,8]

Run it on an otherwise idle machine (the profile's timings and the engine runs share it).
``--write-profile`` saves the last round's calibrated profile (what ``--hardware cpu`` reads).
"""

from __future__ import annotations

import argparse
import json
import statistics

from widellm.sim.calibration import (
    PROBE_SIZES, CalibrationCase, EngineSettings, calibrate, fit_host_overhead, simulate_rows,
)
from widellm.sim.profiles.measure_cpu import measure_cpu_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="preset:deepseek-v3-small")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2,
                        help="engine runs per case and probe in a round; the fastest counts")
    parser.add_argument("--quick-profile", action="store_true")
    parser.add_argument("--write-profile", default=None)
    parser.add_argument("--ep-backends", default="all2all",
                        help="comma-separated all-to-all backends of the DP2 + EP2 cases")
    parser.add_argument("--compare-probe-sizes", default="",
                        help="comma-separated probe sizes of a second fit (e.g. 1,8), from "
                             "the same probes, printed as fit 'cmp'")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    compared = tuple(int(n) for n in args.compare_probe_sizes.split(",") if n)
    shape = (args.num_prompts, args.input_len, args.output_len)
    cases = [CalibrationCase("dp1", 1, *shape)] + [
        CalibrationCase("dp2-ep2" + ("" if b == "all2all" else f"-{b}"), 2, *shape, b)
        for b in args.ep_backends.split(",")]
    # Limits sized to the workload (the whole prompt batch in one step): the same steps as the
    # defaults, with less start-up warm-up.
    settings = EngineSettings(args.model, num_kv_blocks=1024, max_num_seqs=args.num_prompts,
                              max_num_batched_tokens=args.num_prompts * args.input_len)
    print("| round | fit | case | real tok/s | simulated tok/s | error | real mean step ms | "
          "simulated | error | host ms/step (probe) | host ms/seq (probe) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    fits = {"probes": PROBE_SIZES} | ({"cmp": compared} if compared else {})
    errors: dict[tuple[str, str], list[tuple[float, float]]] = {
        (f, c.name): [] for f in fits for c in cases}
    saved = None  # the last round's fit on PROBE_SIZES (--write-profile)
    for r in range(1, args.rounds + 1):
        profile = measure_cpu_profile(quick=args.quick_profile)
        result = calibrate(settings, profile, cases, args.repeats,
                           tuple(sorted(set(PROBE_SIZES) | set(compared))))
        real = {row.case.name: row.real for row in result.rows}
        for fit, sizes in fits.items():
            fitted = fit_host_overhead(settings, profile,
                                       {n: result.probes[n] for n in sizes})
            if fit == "probes":
                saved = fitted
            for row in simulate_rows(settings, fitted, real, cases):
                errors[fit, row.case.name].append((row.throughput_error, row.step_time_error))
                print(f"| {r} | {fit} | {row.case.name} | {row.real.output_tok_s:.1f} | "
                      f"{row.simulated.output_tok_s:.1f} | {row.throughput_error:+.1%} | "
                      f"{row.real.mean_step_s * 1e3:.1f} | "
                      f"{row.simulated.mean_step_s * 1e3:.1f} | {row.step_time_error:+.1%} | "
                      f"{fitted.step_overhead_s * 1e3:.1f} | "
                      f"{fitted.step_overhead_per_seq_s * 1e3:.2f} |", flush=True)
    print("fits: probes = " + ",".join(map(str, PROBE_SIZES))
          + (", cmp = " + ",".join(map(str, compared)) if compared else ""))
    for (fit, name), errs in errors.items():
        print(f"median error {fit} {name}: tok/s {statistics.median(e[0] for e in errs):+.1%},"
              f" mean step {statistics.median(e[1] for e in errs):+.1%}")
    if args.write_profile and saved is not None:
        with open(args.write_profile, "w", encoding="utf-8") as f:
            json.dump(saved.to_json_dict(), f, indent=2)
            f.write("\n")
        print(f"wrote {args.write_profile}")


if __name__ == "__main__":
    main()
