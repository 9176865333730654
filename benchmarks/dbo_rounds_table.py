"""Medians of benchmarks/dbo_rounds.sh's runs, one row per workload, backend and DBO setting.

Usage: python benchmarks/dbo_rounds_table.py OUT_DIR

Throughput is output tok/s for decode and total tok/s for prefill (the prompt tokens are the
work there); "exposed" is the communication time per rank that no compute hid (the step
breakdown's ``comm_exposed_s``), its median over rounds, ranks side by side.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

NAME = re.compile(r"(?P<workload>decode|prefill)-(?P<backend>[\w-]+?)-dbo_(?P<mode>off|on|auto)"
                  r"-r(?P<round>\d+)\.json$")


def _throughput_key(workload: str) -> str:
    return "output_tokens_per_s" if workload == "decode" else "total_tokens_per_s"


def rows(out: Path) -> list[str]:
    runs: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for path in sorted(out.glob("*.json")):
        if (m := NAME.match(path.name)) is not None:
            runs[(m["workload"], m["backend"], m["mode"])].append(json.loads(path.read_text()))
    lines = ["| workload | backend | DBO | tok/s per round | median | / off | exposed comm s "
             "(median per rank) | split steps per rank (last round) |",
             "|---|---|---|---|---:|---:|---|---|"]
    medians = {cell: statistics.median(r[_throughput_key(cell[0])] for r in rs)
               for cell, rs in runs.items()}
    for (workload, backend, mode), rs in sorted(runs.items()):
        key = _throughput_key(workload)
        med = medians[(workload, backend, mode)]
        off = medians.get((workload, backend, "off"))
        ranks = sorted(rs[0]["step_breakdown"])
        exposed = " / ".join(
            f"{statistics.median(r['step_breakdown'][k]['comm_exposed_s'] for r in rs):.1f}"
            for k in ranks)
        split = " / ".join(str(v) for v in rs[-1].get("dbo_steps", {}).values()) or "0"
        ratio = f"{med / off:.3f}" if off else ""
        lines.append(f"| {workload} | {backend} | {mode} | "
                     f"{', '.join(f'{r[key]:.1f}' for r in rs)} | {med:.1f} | {ratio} | "
                     f"{exposed} | {split} |")
    return lines


if __name__ == "__main__":
    print("\n".join(rows(Path(sys.argv[1]))))
