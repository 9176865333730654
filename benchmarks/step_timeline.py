"""Where an offline run's time goes, step by step: the issue-2 workload (N random prompts of I
tokens, O greedy output tokens each, bf16) driven through ``LLMEngine.step()`` with each step
timed, so prefill and decode steps can be told apart::

    .venv/bin/python benchmarks/step_timeline.py --model MODEL [--num-prompts 64] \\
        [--input-len 128] [--output-len 128] [--runs 2] [--output-json FILE]

Prints per run the total, the prefill steps (the first ceil(N x I / step budget) steps) and
the decode steps' total and deciles.
"""

from __future__ import annotations

import argparse
import time

from bench_common import write_result_json
from widellm import LLM, SamplingParams
from widellm.bench.datasets import random_token_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    llm = LLM(args.model, dtype="bfloat16", kv_cache_memory=args.kv_cache_memory)
    engine = llm.llm_engine
    vocab = engine.config.model_config.hf_config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    runs = []
    for run in range(args.runs):
        prompts = random_token_prompts(args.num_prompts, args.input_len, vocab, run)
        engine.add_requests([{"prompt_token_ids": t} for t in prompts],
                            [params] * args.num_prompts)
        steps: list[float] = []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        total = time.perf_counter() - start
        prefill_steps = -(-args.num_prompts * args.input_len
                          // engine.config.scheduler_config.max_num_batched_tokens)
        prefill, decode = steps[:prefill_steps], sorted(steps[prefill_steps:])
        deciles = [decode[i * len(decode) // 10] * 1e3 for i in range(10)] if decode else []
        runs.append({"total_s": total, "prefill_steps_ms": [s * 1e3 for s in prefill],
                     "decode_s": sum(decode), "decode_deciles_ms": deciles})
        print(f"run {run}: {total:.2f} s ({args.num_prompts * args.output_len / total:.1f} "
              f"output tok/s); prefill steps {[round(s * 1e3) for s in prefill]} ms; "
              f"{len(decode)} decode steps {sum(decode):.2f} s, deciles "
              f"{[round(d) for d in deciles]} ms")
    llm.shutdown()
    write_result_json(args.output_json, {"model": args.model, "runs": runs})


if __name__ == "__main__":
    main()
