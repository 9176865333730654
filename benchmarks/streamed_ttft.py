"""Sequential vs streamed KV transfer through ``widellm proxy`` (issue 23): time to the
first token of one request at a time, for prompts of several lengths, through a proxy in
each mode over the same prefill and decode instances, the two modes alternating, fresh
prompts every time (no prefix-cache hit anywhere); with the decode instance's own KV pull
time (``widellm:kv_transfer_seconds``) per request, which the streamed mode should hide.

Usage: python benchmarks/streamed_ttft.py --sequential URL --streamed URL --decode URL
           --vocab-size V [--lengths 512 2048 4096] [--repeats 3] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from benchmarks.kv_transfer_bench import _recv_totals
from widellm.bench.datasets import random_token_prompts

TIMEOUT_S = 600.0


def _ttft(proxy: str, decode: str, prompt: list[int]) -> tuple[float, float]:
    """(seconds to the first token through ``proxy``, seconds the decode spent pulling)."""
    before = _recv_totals(decode)
    start = time.perf_counter()
    r = httpx.post(proxy + "/v1/completions", timeout=TIMEOUT_S, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    ttft = time.perf_counter() - start
    deadline = time.monotonic() + 10  # the metrics follow the engine's stats a step later
    while (after := _recv_totals(decode))[1] == before[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    return ttft, after[0] - before[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequential", required=True)
    p.add_argument("--streamed", required=True)
    p.add_argument("--decode", required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    modes = {"sequential": args.sequential, "streamed": args.streamed}
    rows = []
    for i, n in enumerate(args.lengths):
        prompts = iter(random_token_prompts(2 * args.repeats + 2, n, args.vocab_size,
                                            seed=2000 + i))
        for url in modes.values():  # warm this shape on both paths
            _ttft(url, args.decode, next(prompts))
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        for r in range(args.repeats):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for mode in order:
                runs[mode].append(_ttft(modes[mode], args.decode, next(prompts)))
        row = {"prompt_len": n}
        for mode, values in runs.items():
            row[f"{mode}_ttft_s"] = statistics.median(v[0] for v in values)
            row[f"{mode}_pull_s"] = statistics.median(v[1] for v in values)
            row[f"{mode}_runs"] = values
        row["streamed_over_sequential"] = row["streamed_ttft_s"] / row["sequential_ttft_s"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_runs")}))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
