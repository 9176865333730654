"""Markdown tables from the JSON files of benchmarks/dbo_matrix.sh.

Usage: python benchmarks/dbo_table.py OUT_DIR

Per workload and backend: output tok/s with DBO off / on / auto, the ratios (on / off, and
auto against the better of the two), per rank the exposed and hidden communication seconds of
each setting, and the share of the exposed communication without DBO that DBO hid
(1 - exposed_on / exposed_off, mean over ranks). Then async scheduling off / on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODES = ("off", "on", "auto")
BACKENDS = ("all2all", "allgather_reducescatter", "all2all_fixed")


def _load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _per_rank(run: dict, key: str) -> str:
    return " / ".join(f"{b[key]:.1f}" for b in run["step_breakdown"].values())


def _mean(run: dict, key: str) -> float:
    ranks = list(run["step_breakdown"].values())
    return sum(b[key] for b in ranks) / len(ranks)


def dbo_tables(out: Path) -> list[str]:
    lines = ["| workload | backend | tok/s off / on / auto | on / off | auto / best | "
             "exposed comm s (per rank) off ; on | hidden comm s off ; on | exposed hidden by "
             "DBO | split steps on ; auto |", "|---|---|---|---:|---:|---|---|---:|---|"]
    for workload in ("decode", "prefill"):
        for backend in BACKENDS:
            runs = {m: _load(out, f"{workload}-{backend}-dbo_{m}") for m in MODES}
            if any(r is None for r in runs.values()):
                continue
            tps = {m: r["output_tokens_per_s"] if workload == "decode"
                   else r["total_tokens_per_s"] for m, r in runs.items()}
            best = max(tps["off"], tps["on"])
            hidden_share = 1 - _mean(runs["on"], "comm_exposed_s") / _mean(runs["off"],
                                                                             "comm_exposed_s")
            split = lambda r: " / ".join(str(v) for v in r.get("dbo_steps", {}).values()) or "0"
            lines.append(
                f"| {workload} | {backend} | {tps['off']:.1f} / {tps['on']:.1f} / "
                f"{tps['auto']:.1f} | {tps['on'] / tps['off']:.2f} | {tps['auto'] / best:.3f} | "
                f"{_per_rank(runs['off'], 'comm_exposed_s')} ; "
                f"{_per_rank(runs['on'], 'comm_exposed_s')} | "
                f"{_per_rank(runs['off'], 'comm_hidden_s')} ; "
                f"{_per_rank(runs['on'], 'comm_hidden_s')} | {hidden_share:.0%} | "
                f"{split(runs['on'])} ; {split(runs['auto'])} |")
    return lines


def async_table(out: Path) -> list[str]:
    lines = ["| run | sync tok/s | async tok/s | async / sync |", "|---|---:|---:|---:|"]
    for name in ("decode-dp1", "decode-dp2-all2all"):
        sync, asy = _load(out, f"{name}-sync"), _load(out, f"{name}-async")
        if sync and asy:
            a, b = sync["output_tokens_per_s"], asy["output_tokens_per_s"]
            lines.append(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
    return lines


if __name__ == "__main__":
    out = Path(sys.argv[1])
    print("\n".join(dbo_tables(out)))
    print()
    print("\n".join(async_table(out)))
