"""Table of benchmarks/async_compare.sh's runs: output tok/s per run, medians, async / sync.

Usage: python benchmarks/async_table.py OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main(out_dir: str) -> None:
    runs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for path in sorted(Path(out_dir).glob("*.json")):
        shape, mode, _round = path.stem.split("-")
        runs[(shape, mode)].append(json.loads(path.read_text())["output_tokens_per_s"])
    print("| shape | sync tok/s (runs) | async tok/s (runs) | median async / sync |")
    print("|---|---|---|---:|")
    for shape in sorted({s for s, _ in runs}):
        sync, asyn = runs[(shape, "sync")], runs[(shape, "async")]
        if not sync or not asyn:
            continue
        ratio = statistics.median(asyn) / statistics.median(sync)
        print(f"| {shape} | {' / '.join(f'{v:.1f}' for v in sync)} | "
              f"{' / '.join(f'{v:.1f}' for v in asyn)} | {ratio:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1])
