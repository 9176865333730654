"""The simulator's calibration against the real engine on this machine (issue 26): per round,
measure the CPU profile, run each case on the engine (probes of 1 and 8 sequences first, which
fit the profile's host time per step; every engine number the fastest of ``--repeats`` runs),
simulate each case; print every round and the medians.

    .venv/bin/python benchmarks/sim_calibration.py [--rounds 3] [--num-prompts 32
        --input-len 64 --output-len 64] [--write-profile widellm/sim/profiles/cpu.json]
        [--ep-backends all2all,all2all_fixed] [--repeats 2]

Run it on an otherwise idle machine (the profile's timings and the engine runs share it).
``--write-profile`` saves the last round's calibrated profile (what ``--hardware cpu`` reads).
"""

from __future__ import annotations

import argparse
import json
import statistics

from widellm.sim.calibration import CalibrationCase, EngineSettings, calibrate
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
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    shape = (args.num_prompts, args.input_len, args.output_len)
    cases = [CalibrationCase("dp1", 1, *shape)] + [
        CalibrationCase("dp2-ep2" + ("" if b == "all2all" else f"-{b}"), 2, *shape, b)
        for b in args.ep_backends.split(",")]
    # Limits sized to the workload (the whole prompt batch in one step): the same steps as the
    # defaults, with less start-up warm-up.
    settings = EngineSettings(args.model, num_kv_blocks=1024, max_num_seqs=args.num_prompts,
                              max_num_batched_tokens=args.num_prompts * args.input_len)
    print("| round | case | real tok/s | simulated tok/s | error | real mean step ms | "
          "simulated | error | host ms/step (probe) | host ms/seq (probe) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    errors: dict[str, list[tuple[float, float]]] = {c.name: [] for c in cases}
    fitted = None
    for r in range(1, args.rounds + 1):
        profile = measure_cpu_profile(quick=args.quick_profile)
        fitted, rows = calibrate(settings, profile, cases, args.repeats)
        for row in rows:
            errors[row.case.name].append((row.throughput_error, row.step_time_error))
            print(f"| {r} | {row.case.name} | {row.real.output_tok_s:.1f} | "
                  f"{row.simulated.output_tok_s:.1f} | {row.throughput_error:+.1%} | "
                  f"{row.real.mean_step_s * 1e3:.1f} | {row.simulated.mean_step_s * 1e3:.1f} | "
                  f"{row.step_time_error:+.1%} | {fitted.step_overhead_s * 1e3:.1f} | "
                  f"{fitted.step_overhead_per_seq_s * 1e3:.2f} |", flush=True)
    for name, errs in errors.items():
        print(f"median error {name}: tok/s {statistics.median(e[0] for e in errs):+.1%}, "
              f"mean step {statistics.median(e[1] for e in errs):+.1%}")
    if args.write_profile and fitted is not None:
        with open(args.write_profile, "w", encoding="utf-8") as f:
            json.dump(fitted.to_json_dict(), f, indent=2)
            f.write("\n")
        print(f"wrote {args.write_profile}")


if __name__ == "__main__":
    main()
