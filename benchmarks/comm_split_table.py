"""Exposed MoE communication split into waiting for a peer and the transfer itself, per cell of
benchmarks/dbo_rounds.sh's runs (each run's ``NAME.trace/rank*.json``, see
widellm/comm_trace.py), medians over rounds, rank 0 / rank 1.

Usage: python benchmarks/comm_split_table.py OUT_DIR|TRACE_DIR [MAX_TOKENS]
(TRACE_DIR: one run's WIDELLM_COMM_TRACE_DIR, holding its rank*.json)

With MAX_TOKENS, a second table counts only the transfers of forwards of at most that many rows
on the largest rank (decode steps: a decode-heavy run's first steps are its prompts, whose
seconds-long segments make most of a short run's waits for a peer).

Columns (seconds per rank over the run): exposed = blocked in a transfer's wait (the step
breakdown's comm_exposed); peers = the part of it before the last rank had launched that
transfer; transfer = the rest; hidden = in flight while the rank computed; duration = from the
last launch to completion, summed (how long the transfers themselves took); launch spread =
the median over transfers of the last rank's launch minus the first's, in ms.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from widellm.comm_trace import Exchange, load, split_exposed

NAME = re.compile(r"(?P<cell>(?:decode|prefill)-[\w-]+?-dbo_(?:off|on|auto))-r(?P<round>\d+)\.trace$")
KEYS = ("exposed_s", "exposed_waiting_for_peers_s", "exposed_transfer_s", "hidden_s",
        "transfer_s")


def launch_spread_ms(logs: list[list[Exchange]]) -> float:
    launches = defaultdict(list)
    for log in logs:
        for e in log:
            launches[e.seq].append(e.launched)
    return statistics.median(max(t) - min(t) for t in launches.values()) * 1e3


def rows(out: Path, max_tokens: int | None = None) -> list[str]:
    runs: dict[str, list[list[dict[str, float]]]] = defaultdict(list)
    spreads: dict[str, list[float]] = defaultdict(list)
    # One run's trace directory, or dbo_rounds.sh's output with one NAME.trace per run.
    traced = ({out.name: [out]} if any(out.glob("rank*.json")) else defaultdict(list))
    for path in sorted(out.glob("*.trace")):
        if (m := NAME.match(path.name)) is not None and any(path.glob("rank*.json")):
            traced[m["cell"]].append(path)
    for cell, paths in traced.items():
        for path in paths:
            logs = load(path)
            runs[cell].append(split_exposed(logs, max_tokens))
            spreads[cell].append(launch_spread_ms(logs))
    lines = ["| cell | rounds | exposed | of it: waiting for a peer | of it: transfer | "
             "hidden | transfer duration | peers / exposed | launch spread ms |",
             "|---|---:|---|---|---|---|---|---:|---:|"]
    for cell, splits in sorted(runs.items()):
        ranks = range(len(splits[0]))
        med = {k: [statistics.median(s[r][k] for s in splits) for r in ranks] for k in KEYS}
        cols = [" / ".join(f"{v:.1f}" for v in med[k]) for k in KEYS]
        share = sum(med["exposed_waiting_for_peers_s"]) / max(sum(med["exposed_s"]), 1e-9)
        lines.append(f"| {cell} | {len(splits)} | " + " | ".join(cols) + f" | {share:.0%} | "
                     f"{statistics.median(spreads[cell]):.2f} |")
    return lines


if __name__ == "__main__":
    out = Path(sys.argv[1])
    print("All transfers:\n\n" + "\n".join(rows(out)))
    if len(sys.argv) > 2:
        bound = int(sys.argv[2])
        print(f"\nTransfers of forwards of at most {bound} rows:\n\n"
              + "\n".join(rows(out, bound)))
