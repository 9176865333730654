"""Offline throughput of vLLM on random token-id prompts: the baseline widellm is compared with.

Runs in vLLM's own environment (never widellm's); it reads the model folder directly, so make
preset folders with widellm first and pass the path::

    .venv/bin/python -m widellm.model.presets preset:deepseek-v3-small   # prints PATH
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \\
        /work/vllm-venv/bin/python benchmarks/vllm_throughput.py --model PATH \\
        --input-len 128 --output-len 128 --num-prompts 64 --dtype bfloat16

Prompts follow the shared rule used by every throughput script here (and widellm's own
benchmark): ``numpy.random.RandomState(seed).randint(100, vocab_size - 100,
size=(num_prompts, input_len))``, one row per prompt, so all engines see identical inputs.
Generation is greedy with ``ignore_eos`` so every request produces exactly ``output_len``
tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time

from bench_common import GIB, KIB, random_prompt_token_ids, throughput_fields, write_result_json

# How often the process-tree memory sampler looks; fine enough for a run of many seconds.
RSS_SAMPLE_INTERVAL_S = 0.2


def read_vocab_size(model: str) -> int:
    """vocab_size from the checkpoint's config.json (text config for multimodal wrappers)."""
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def peak_rss_gib() -> dict[str, float]:
    """Peak resident memory of this process and of its largest finished child, in GiB.

    ru_maxrss is in KiB on Linux; children only count once they have exited, so call this
    after the engine is shut down.
    """
    self_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB / GIB
    child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * KIB / GIB
    return {"self": self_peak, "children": child_peak, "total": self_peak + child_peak}


class TreeRssSampler:
    """Track the peak summed RSS of this process and all its descendants.

    vLLM runs the engine core and its worker as child and grandchild processes; getrusage
    misses a grandchild its parent never reaps, so sample the live tree instead.
    """

    def __init__(self, interval_s: float = RSS_SAMPLE_INTERVAL_S) -> None:
        import psutil

        self._root = psutil.Process()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.peak_bytes = 0

    def _sample(self) -> int:
        import psutil

        total = 0
        for proc in [self._root, *self._root.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.Error:  # exited between listing and reading
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._sample())
            self._stop.wait(self._interval_s)

    def __enter__(self) -> TreeRssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (names follow vLLM's own benchmark_throughput)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt token ids")
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV cache budget; VLLM_CPU_KVCACHE_SPACE, if set, takes precedence in vLLM",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--output-json", default=None, help="write the results here too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build the engine, time one ``generate`` over all prompts, report throughput."""
    args = parse_args(argv)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm

    vocab_size = read_vocab_size(args.model)
    prompts = [
        TokensPrompt(prompt_token_ids=ids)
        for ids in random_prompt_token_ids(
            vocab_size, args.num_prompts, args.input_len, args.seed
        )
    ]
    engine_kwargs = {}
    if args.kv_cache_memory_gb is not None:
        engine_kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_memory_gb * GIB)
    if args.max_num_seqs is not None:
        engine_kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens

    sampler = TreeRssSampler()
    with sampler:
        start_load = time.perf_counter()
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.input_len + args.output_len,
            seed=args.seed,
            **engine_kwargs,
        )
        load_s = time.perf_counter() - start_load
        sampling = SamplingParams(
            temperature=0.0, max_tokens=args.output_len, ignore_eos=True
        )
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        elapsed = time.perf_counter() - start

    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    expected = args.num_prompts * args.output_len
    if output_tokens != expected:
        print(f"warning: {output_tokens} output tokens, expected {expected}", file=sys.stderr)
    first_ids = list(outputs[0].outputs[0].token_ids[:16])

    # Stop the engine-core process so its peak memory shows up under RUSAGE_CHILDREN.
    llm.llm_engine.engine_core.shutdown()
    rss = peak_rss_gib()

    result = {
        "engine": "vllm",
        "version": vllm.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "load_s": round(load_s, 2),
        **throughput_fields(args.num_prompts, input_tokens, output_tokens, elapsed),
        "peak_rss_gib": rss,
        "peak_tree_rss_gib": sampler.peak_bytes / GIB,
        "first_output_ids": first_ids,
        "env": {
            k: v for k, v in os.environ.items() if k.startswith(("VLLM_CPU_", "OMP_"))
        },
    }
    print(
        f"vllm {vllm.__version__}: {args.num_prompts} prompts x {args.input_len} in / "
        f"{args.output_len} out in {elapsed:.2f} s (load {load_s:.1f} s)\n"
        f"  requests/s {result['requests_per_s']:.3f}  output tok/s "
        f"{result['output_tokens_per_s']:.1f}  total tok/s {result['total_tokens_per_s']:.1f}\n"
        f"  peak RSS GiB: live process tree {sampler.peak_bytes / GIB:.2f}; getrusage self "
        f"{rss['self']:.2f} + reaped children {rss['children']:.2f} = {rss['total']:.2f}\n"
        f"  first output ids: {first_ids}"
    )
    write_result_json(args.output_json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
