"""Medians of benchmarks/ab_compare.sh's runs: one row per cell, base against new.

Usage: python benchmarks/ab_table.py OUT_DIR

Throughput is output tok/s; "exposed" and "communication" are the step breakdown's
``comm_exposed_s`` and ``communication_s`` per rank (medians over rounds, ranks side by side),
when the runs collected it.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

NAME = re.compile(r"(?P<cell>.+)-(?P<side>base|new)-r(?P<round>\d+)\.json$")
SIDES = ("base", "new")


def _per_rank(runs: list[dict], field: str) -> str:
    breakdowns = [r["step_breakdown"] for r in runs if r.get("step_breakdown")]
    if not breakdowns:
        return ""
    return " / ".join(f"{statistics.median(b[k][field] for b in breakdowns):.1f}"
                      for k in sorted(breakdowns[0]))


def rows(out: Path) -> list[str]:
    runs: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for path in sorted(out.glob("*.json")):
        if (m := NAME.match(path.name)) is not None:
            runs[(m["cell"], m["side"])].append(json.loads(path.read_text()))
    lines = ["| cell | side | output tok/s per round | median | new / base | communication s "
             "per rank | exposed s per rank |", "|---|---|---|---:|---:|---|---|"]
    for cell in sorted({c for c, _ in runs}):
        medians = {side: statistics.median(r["output_tokens_per_s"] for r in runs[(cell, side)])
                   for side in SIDES if runs.get((cell, side))}
        for side in SIDES:
            rs = runs.get((cell, side))
            if not rs:
                continue
            ratio = (f"{medians['new'] / medians['base']:.3f}"
                     if side == "new" and "base" in medians else "")
            each = ", ".join(f"{r['output_tokens_per_s']:.1f}" for r in rs)
            lines.append(f"| {cell} | {side} | {each} | "
                         f"{medians[side]:.1f} | {ratio} | "
                         f"{_per_rank(rs, 'communication_s')} | "
                         f"{_per_rank(rs, 'comm_exposed_s')} |")
    return lines


if __name__ == "__main__":
    print("\n".join(rows(Path(sys.argv[1]))))
