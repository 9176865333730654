"""The KV transfer itself, for issue 23: for prompts of 256..4096 tokens, a prefill
instance's prefill time (one output token, measured by the client) against the time the decode
instance spends pulling that prompt's KV (from its widellm:kv_transfer_seconds metric) and the
bytes it moved, so GB/s and transfer time / prefill time per prompt length.

Usage: python benchmarks/kv_transfer_bench.py --prefill URL --decode URL --vocab-size V
"""

from __future__ import annotations

import argparse
import json
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from widellm.bench.datasets import random_token_prompts

TIMEOUT_S = 600.0


def _recv_totals(decode: str) -> tuple[float, float]:
    """(seconds, bytes) the decode instance has spent / received pulling KV, all ranks."""
    seconds = nbytes = 0.0
    for fam in text_string_to_metric_families(httpx.get(decode + "/metrics").text):
        for s in fam.samples:
            if s.labels.get("direction") != "recv":
                continue
            if s.name == "widellm:kv_transfer_seconds_total":
                seconds += s.value
            elif s.name == "widellm:kv_transfer_bytes_total":
                nbytes += s.value
    return seconds, nbytes


def _one(prefill: str, decode: str, prompt: list[int]) -> tuple[float, float, float]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    r = httpx.post(prefill + "/v1/completions", timeout=TIMEOUT_S,
                   json={**body, "kv_transfer_params": {"do_remote_decode": True}})
    r.raise_for_status()
    prefill_s = time.perf_counter() - start
    before = _recv_totals(decode)
    r2 = httpx.post(decode + "/v1/completions", timeout=TIMEOUT_S,
                    json={**body, "kv_transfer_params": r.json()["kv_transfer_params"]})
    r2.raise_for_status()
    # The metrics follow the engine's stats a step later: wait until the load shows.
    deadline = time.monotonic() + 10
    while (after := _recv_totals(decode))[1] == before[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    return prefill_s, after[0] - before[0], after[1] - before[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    rows = []
    for i, n in enumerate(args.lengths):
        # Fresh prompts every time: no prefix-cache hit on either side.
        prompts = random_token_prompts(args.repeats + 1, n, args.vocab_size, seed=1000 + i)
        _one(args.prefill, args.decode, prompts[-1])  # warm this shape
        runs = [_one(args.prefill, args.decode, q) for q in prompts[:-1]]
        pre, xfer, nbytes = (float(np.median([r[k] for r in runs])) for k in range(3))
        rows.append({"prompt_len": n, "prefill_s": pre, "transfer_s": xfer, "bytes": nbytes,
                     "gb_per_s": nbytes / xfer / 1e9 if xfer else 0.0,
                     "transfer_over_prefill": xfer / pre})
        print(json.dumps(rows[-1]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
