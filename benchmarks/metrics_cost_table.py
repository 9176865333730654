"""Medians of benchmarks/metrics_cost.sh's runs: output tok/s with every request histogram
("with") and without the ones vLLM's V1 set added ("without"), and the cost in percent.
Usage: python benchmarks/metrics_cost_table.py OUT_DIR"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

FIELDS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "completed")
SIDES = ("without", "with")


def main() -> None:
    out = Path(sys.argv[1])
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for path in sorted(out.glob("*-r*.json")):
        runs[path.stem.rsplit("-", 1)[0]].append(json.loads(path.read_text()))
    med = {side: {f: statistics.median(r[f] for r in rs) for f in FIELDS}
           for side, rs in runs.items() if rs}
    for side, rs in runs.items():
        print(side, "output tok/s per run:", [round(r["output_throughput"], 1) for r in rs])
    print("| side | runs | output tok/s | mean TTFT ms | mean TPOT ms |")
    print("|---|---|---|---|---|")
    for side, m in med.items():
        print(f"| {side} | {len(runs[side])} | {m['output_throughput']:.1f} | "
              f"{m['mean_ttft_ms']:.0f} | {m['mean_tpot_ms']:.1f} |")
    if len(med) == len(SIDES):
        cost = 1 - med["with"]["output_throughput"] / med["without"]["output_throughput"]
        print(f"the histograms' cost: {100 * cost:.2f}% of output tok/s (goal: at most 2%)")


if __name__ == "__main__":
    main()
