"""Medians of benchmarks/structured_compare.sh's runs: output tok/s and latency with every
request under the JSON schema vs none, and their ratio. Usage: python
benchmarks/structured_table.py OUT_DIR"""

from __future__ import annotations

import sys
from pathlib import Path

from serve_sides import side_medians

SIDES = ("none", "schema")


def main() -> None:
    med = side_medians(Path(sys.argv[1]), SIDES)
    if len(med) == len(SIDES):
        ratio = med["schema"]["output_throughput"] / med["none"]["output_throughput"]
        print(f"schema / none output tok/s: {ratio:.3f}")


if __name__ == "__main__":
    main()
