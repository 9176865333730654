"""Tables of benchmarks/disagg_compare.sh's results: per model, the median over repeats of
each setup's numbers and the disaggregated / colocated ratios; and the transfer rows.

Usage: python benchmarks/disagg_table.py OUT_DIR
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys

KEYS = ("decoder_itl_p99_ms", "decoder_itl_p50_ms", "decoder_ttft_p99_ms", "long_ttft_p99_ms",
        "output_tok_s")


def main(out: str) -> None:
    runs: dict[tuple[str, str], list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(out, "*-[0-9]*.json"))):
        m = re.match(r"(.+)-(colocated|disagg)-(\d+)\.json$", os.path.basename(path))
        if m:
            with open(path) as f:
                runs.setdefault((m.group(1), m.group(2)), []).append(json.load(f)["result"])
    for model in sorted({k[0] for k in runs}):
        print(f"\n{model}: median of {len(runs.get((model, 'colocated'), []))} runs each")
        print("| metric | colocated (2 cores) | 1 P + 1 D (1 core each) | P/D / colocated |")
        print("|---|---|---|---|")
        for key in KEYS:
            med = {s: statistics.median(r[key] for r in runs.get((model, s), [{key: 0}]))
                   for s in ("colocated", "disagg")}
            ratio = med["disagg"] / med["colocated"] if med["colocated"] else float("nan")
            print(f"| {key} | {med['colocated']:.0f} | {med['disagg']:.0f} | {ratio:.3f} |")
        each = {s: [round(r["decoder_itl_p99_ms"]) for r in runs.get((model, s), [])]
                for s in ("colocated", "disagg")}
        print(f"\n(p99 ITL per run: colocated {each['colocated']}, P/D {each['disagg']}; "
              f"failed requests: {sum(r['failed'] for v in runs.values() for r in v)})")
        path = os.path.join(out, f"{model}-transfer.json")
        if os.path.exists(path):
            with open(path) as f:
                rows = json.load(f)["rows"]
            print("\n| prompt tokens | prefill s | transfer s | MB | GB/s | transfer / prefill |")
            print("|---|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['prompt_len']} | {r['prefill_s']:.2f} | {r['transfer_s']:.3f} | "
                      f"{r['bytes'] / 1e6:.1f} | {r['gb_per_s']:.2f} | "
                      f"{100 * r['transfer_over_prefill']:.1f}% |")


if __name__ == "__main__":
    main(sys.argv[1])
