"""Medians of two-sided `widellm bench serve` comparisons: OUT_DIR holds one JSON per run named
``SIDE-rN.json`` (as benchmarks/structured_compare.sh and metrics_cost.sh write them); prints
each side's runs and a table of medians. Shared by the comparisons' table scripts."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

FIELDS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "completed")


def side_medians(out: Path, sides: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Read every ``SIDE-rN.json`` of ``out``, print the per-run output tok/s and the medians
    table, and return side -> field -> median (sides without runs left out)."""
    runs: dict[str, list[dict]] = {side: [] for side in sides}
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
    return med
