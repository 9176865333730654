"""Decode with CUDA graphs against ``--enforce-eager`` at batch 1-64 (issue 25's goal: graphs
at least 1.5x eager), run by benchmarks/gpu/check.sh.

For each batch size, ``batch`` prompts of 16 tokens generate 64 tokens each (greedy, EOS
ignored), so the run is almost all decode steps of ``batch`` rows; output tok/s = generated
tokens / generate() wall time. Both engines stay loaded; the two sides alternate per round and
the median of the rounds is reported.

``--device cpu`` runs the script through the graph runner's eager twin (its "graphs" are eager
forwards over the step buffers): a check of the script, not a measurement.

Usage: python benchmarks/gpu/graph_speedup.py [--model M] [--device cuda|cpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from device_side import engine_side

BATCHES = (1, 2, 4, 8, 16, 32, 64)
PROMPT_LEN, NEW_TOKENS = 16, 64
ROUNDS = 3


def tok_per_s(llm, batch: int) -> float:
    from widellm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [[3 + (7 * i + j) % 200 for j in range(PROMPT_LEN)] for i in range(batch)]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * NEW_TOKENS / (time.perf_counter() - start)


def main() -> int:
    from widellm import LLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="preset:deepseek-v3-small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    graph_kwargs = engine_side(args.device, ",".join(map(str, BATCHES)))
    common = dict(dtype=args.dtype, device=args.device, max_num_seqs=max(BATCHES),
                  max_model_len=PROMPT_LEN + NEW_TOKENS + 16)
    engines = {"graphs": LLM(args.model, **common, **graph_kwargs),
               "eager": LLM(args.model, **common, enforce_eager=True)}
    rows = []
    try:
        for batch in BATCHES:
            for llm in engines.values():
                tok_per_s(llm, batch)  # warm: kernels, allocator
            runs = {name: [] for name in engines}
            for r in range(args.rounds):
                order = list(engines) if r % 2 == 0 else list(reversed(engines))
                for name in order:
                    runs[name].append(tok_per_s(engines[name], batch))
            med = {name: statistics.median(v) for name, v in runs.items()}
            rows.append({"batch": batch, "graphs_tok_s": round(med["graphs"], 1),
                         "eager_tok_s": round(med["eager"], 1),
                         "ratio": round(med["graphs"] / med["eager"], 3)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": args.device, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
