"""Wall time of one prompt step, offline, in widellm or in vLLM: ``--prompts`` random-token
prompts of ``--input-len`` tokens and one output token per ``generate`` call, prefix caching off
so every call prefills, bf16 (or ``--dtype``), a 2,048-token step budget as both servers use::

    .venv/bin/python benchmarks/prefill_step.py --engine widellm --model /work/smollm2-hf
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \\
        /work/vllm-venv/bin/python benchmarks/prefill_step.py --engine vllm --model /work/smollm2-hf

Prints every call's time and the median. A serving benchmark's p99 TTFT is about two such steps
(docs/BENCHMARKS.md), so this is the number to compare when TTFT differs; run the engines
close together in time, since the machines drift.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

STEP_BUDGET = 2048
KV_CACHE_GIB = 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine", choices=["widellm", "vllm"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    common = dict(dtype=args.dtype, max_model_len=STEP_BUDGET,
                  max_num_batched_tokens=STEP_BUDGET, enable_prefix_caching=False)
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(args.model, **common)  # KV space: VLLM_CPU_KVCACHE_SPACE

        def as_prompts(ids):
            return [TokensPrompt(prompt_token_ids=i) for i in ids]
    else:
        from widellm import LLM, SamplingParams

        llm = LLM(args.model, kv_cache_memory=f"{KV_CACHE_GIB}GiB", **common)

        def as_prompts(ids):
            return ids
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rs = np.random.RandomState(args.seed)
    times = []
    for _ in range(args.repeats):
        ids = rs.randint(100, vocab - 100, size=(args.prompts, args.input_len)).tolist()
        start = time.perf_counter()
        llm.generate(as_prompts(ids), params, use_tqdm=False)
        times.append((time.perf_counter() - start) * 1e3)
    print(f"{args.engine}: {args.prompts} x {args.input_len} tokens, ms per step:",
          [round(t) for t in times], f"median {statistics.median(times):.0f}")


if __name__ == "__main__":
    main()
