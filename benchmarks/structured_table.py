"""Medians of benchmarks/structured_compare.sh's runs: output tok/s and latency with every
request under the JSON schema vs none, and their ratio. Usage: python
benchmarks/structured_table.py OUT_DIR"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

FIELDS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "completed")


def main() -> None:
    out = Path(sys.argv[1])
    runs: dict[str, list[dict]] = {"none": [], "schema": []}
    for path in sorted(out.glob("*-r*.json")):
        runs[path.stem.split("-")[0]].append(json.loads(path.read_text()))
    med = {mode: {f: statistics.median(r[f] for r in rs) for f in FIELDS}
           for mode, rs in runs.items() if rs}
    for mode, rs in runs.items():
        print(mode, "output tok/s per run:", [round(r["output_throughput"], 1) for r in rs])
    print("| side | runs | output tok/s | mean TTFT ms | mean TPOT ms |")
    print("|---|---|---|---|---|")
    for mode, m in med.items():
        print(f"| {mode} | {len(runs[mode])} | {m['output_throughput']:.1f} | "
              f"{m['mean_ttft_ms']:.0f} | {m['mean_tpot_ms']:.1f} |")
    if len(med) == 2:
        ratio = med["schema"]["output_throughput"] / med["none"]["output_throughput"]
        print(f"schema / none output tok/s: {ratio:.3f}")


if __name__ == "__main__":
    main()
