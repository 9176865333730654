"""Measure this machine's simulator profile and write it as JSON (default:
``widellm/sim/profiles/cpu.json``, the profile ``load_profile("cpu")`` reads).

    .venv/bin/python benchmarks/sim_cpu_profile.py            # full timings (~1-2 min)
    .venv/bin/python benchmarks/sim_cpu_profile.py --quick    # ~20 s
    .venv/bin/python benchmarks/sim_cpu_profile.py --output /tmp/cpu.json

Run it on an otherwise idle machine: every figure is a best-of-N timing, and other load on
the cores lowers all of them. The committed profile also carries the host time per step that
``benchmarks/sim_calibration.py --write-profile`` fits on the real engine; this script leaves
it at 0.
"""

from __future__ import annotations

import argparse
import json
import time

from widellm.sim.hardware import CPU_PROFILE_PATH
from widellm.sim.profiles.measure_cpu import measure_cpu_profile, profile_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings (~20 s)")
    parser.add_argument("--output", default=CPU_PROFILE_PATH, help="JSON file to write")
    parser.add_argument("--no-all-to-all", action="store_true",
                        help="skip the 2-process gloo all-to-all measurement")
    args = parser.parse_args()
    start = time.perf_counter()
    profile = measure_cpu_profile(quick=args.quick, with_all_to_all=not args.no_all_to_all)
    data = profile_json(profile)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    print(json.dumps(data, indent=2))
    print(f"wrote {args.output} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
