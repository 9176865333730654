"""How the calibration's host time grows with the batch (issue 26): the real engine's mean step
minus the bare simulated one (the CPU profile measured here, no host time), for decode probes
of 1 to 32 sequences on one rank, each the fastest of ``--repeats`` interleaved runs; then what
the calibration's line (least squares over the ``PROBE_SIZES`` residuals) and the earlier
two-point line through 1 and 8 predict at the largest size, against the residual measured
there.

    .venv/bin/python benchmarks/sim_probe_sizes.py [--sizes 1,4,8,16,32] [--repeats 3]

Run it on an otherwise idle machine (the profile's timings and the engine runs share it).
"""

from __future__ import annotations

import argparse
import itertools

from widellm.sim.calibration import (
    PROBE_INPUT_LEN, PROBE_OUTPUT_LEN, PROBE_SIZES, EngineSettings, host_time_line, make_llm,
    probe_case, simulate_case, timed_generate, without_host_time,
)
from widellm.sim.profiles.measure_cpu import measure_cpu_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="preset:deepseek-v3-small")
    parser.add_argument("--sizes", default="1,4,8,16,24,32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")} | set(PROBE_SIZES) | {1, 8})
    largest = sizes[-1]
    # The benchmark's engine limits (benchmarks/sim_calibration.py, 32 x 64 in): the same steps.
    settings = EngineSettings(args.model, num_kv_blocks=1024, max_num_seqs=largest,
                              max_num_batched_tokens=largest * 64)
    bare = without_host_time(measure_cpu_profile(quick=False))
    llm = make_llm(settings)
    seeds = itertools.count(settings.seed)  # fresh prompts every run: no prefix-cache hits
    steps: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        for _ in range(args.repeats):  # interleaved: a slow spell hits one run of each
            for n in sizes:
                steps[n].append(timed_generate(llm, n, PROBE_INPUT_LEN, PROBE_OUTPUT_LEN,
                                               next(seeds)).mean_step_s)
    finally:
        llm.shutdown()
    print("| sequences | bare simulated step ms | real step ms (runs) | residual ms (fastest) |")
    print("|---:|---:|---|---:|")
    residual = {}
    for n in sizes:
        sim = simulate_case(settings, bare, probe_case(n)).mean_step_s
        residual[n] = min(steps[n]) - sim
        runs = ", ".join(f"{s * 1e3:.1f}" for s in steps[n])
        print(f"| {n} | {sim * 1e3:.1f} | {runs} | {residual[n] * 1e3:.1f} |")
    for name, fit_sizes in (("least squares over " + ",".join(map(str, PROBE_SIZES)),
                             PROBE_SIZES), ("line through 1 and 8", (1, 8))):
        per_step, per_seq = host_time_line(list(fit_sizes), [residual[n] for n in fit_sizes])
        predicted = per_step + per_seq * largest
        print(f"{name}: {per_step * 1e3:.1f} ms + {per_seq * 1e3:.2f} ms per sequence; at "
              f"{largest}: {predicted * 1e3:.1f} ms predicted, {residual[largest] * 1e3:.1f} ms "
              f"measured")


if __name__ == "__main__":
    main()
