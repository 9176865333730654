"""Decode step time with the fused decode stack against the layers' own forwards, alternated
in one engine (widellm/model/fused_decode.py): B random prompts of I tokens are prefilled,
then blocks of decode steps run with the stack on and off in turn, so the machine's drift hits
both alike::

    .venv/bin/python benchmarks/fused_decode_ab.py --model MODEL [--batch 16] \\
        [--input-len 280] [--rounds 8] [--steps 8] [--output-json FILE]

Prints the median and minimum milliseconds per decode step of each path.
"""

from __future__ import annotations

import argparse
import time

from bench_common import write_result_json
from widellm import LLM, SamplingParams
from widellm.bench.datasets import random_token_prompts

WARMUP_STEPS = 6
TOKEN_ID_RANGE = 1000  # prompt token ids below every model's vocabulary size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input-len", type=int, default=280)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="decode steps per block")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    llm = LLM(args.model, dtype="bfloat16", kv_cache_memory=args.kv_cache_memory)
    engine = llm.llm_engine
    decoder = engine.engine_core.model_runner.model.model
    fused = decoder.fused_decode
    if fused is None:
        raise SystemExit(f"{args.model}: no fused decode stack covers this model here")
    prompts = random_token_prompts(args.batch, args.input_len, TOKEN_ID_RANGE, 0)
    max_tokens = WARMUP_STEPS + 2 * args.rounds * args.steps + 1
    engine.add_requests([{"prompt_token_ids": t} for t in prompts],
                        [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)]
                        * args.batch)
    for _ in range(WARMUP_STEPS):  # the prefill, then a few decodes
        engine.step()
    times: dict[str, list[float]] = {"fused": [], "layers": []}
    for _ in range(args.rounds):
        for name in times:
            decoder.fused_decode = fused if name == "fused" else None
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    decoder.fused_decode = fused
    result = {"model": args.model, "batch": args.batch, "input_len": args.input_len}
    for name, values in times.items():
        ordered = sorted(values)
        result[name] = {"median_ms": ordered[len(ordered) // 2], "min_ms": ordered[0],
                        "all_ms": values}
        print(f"batch {args.batch}: {name:6s} median {ordered[len(ordered) // 2]:6.1f} ms/step"
              f"  min {ordered[0]:6.1f}")
    llm.shutdown()
    write_result_json(args.output_json, result)


if __name__ == "__main__":
    main()
