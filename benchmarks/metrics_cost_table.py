"""Medians of benchmarks/metrics_cost.sh's runs: output tok/s with every request histogram
("with") and without the ones vLLM's V1 set added ("without"), and the cost in percent.
Usage: python benchmarks/metrics_cost_table.py OUT_DIR"""

from __future__ import annotations

import sys
from pathlib import Path

from serve_sides import side_medians

SIDES = ("without", "with")


def main() -> None:
    med = side_medians(Path(sys.argv[1]), SIDES)
    if len(med) == len(SIDES):
        cost = 1 - med["with"]["output_throughput"] / med["without"]["output_throughput"]
        print(f"the histograms' cost: {100 * cost:.2f}% of output tok/s (goal: at most 2%)")


if __name__ == "__main__":
    main()
