"""Offline throughput of plain transformers ``generate`` on the shared random prompts.

The floor every engine should beat: batched greedy generation with the HF model classes, in
batches of ``--batch-size`` prompts, timed over all batches (model loading excluded)::

    .venv/bin/python benchmarks/hf_throughput.py --model PATH \\
        --input-len 128 --output-len 128 --num-prompts 64 --dtype bfloat16 --batch-size 32

Prompts are the same as in ``vllm_throughput.py`` (``numpy.random.RandomState(seed)
.randint(100, vocab_size - 100, size=(num_prompts, input_len))``). All prompts have the same
length, so no padding is involved. Every request produces exactly ``output_len`` tokens: the
end-of-sequence id is removed from the generation config instead of masked, so greedy picks
stay the plain argmax, as with vLLM's ``ignore_eos``.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from bench_common import GIB, KIB, random_prompt_token_ids, throughput_fields, write_result_json



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options, matching vllm_throughput.py where they overlap."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt token ids")
    parser.add_argument(
        "--experts-implementation",
        default=None,
        help="transformers MoE kernel (eager, grouped_mm, batched_mm); default: its own choice",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--output-json", default=None, help="write the results here too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Load the model, run greedy ``generate`` batch by batch, report throughput."""
    args = parse_args(argv)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    start_load = time.perf_counter()
    load_kwargs = {}
    if args.experts_implementation is not None:
        load_kwargs["experts_implementation"] = args.experts_implementation
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), **load_kwargs
    )
    model.eval()
    load_s = time.perf_counter() - start_load

    generation_config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
        bos_token_id=model.config.bos_token_id,
    )
    prompts = random_prompt_token_ids(
        model.config.vocab_size, args.num_prompts, args.input_len, args.seed
    )
    output_tokens = 0
    first_ids: list[int] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for begin in range(0, len(prompts), args.batch_size):
            input_ids = torch.tensor(prompts[begin : begin + args.batch_size])
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=generation_config,
            )
            new_tokens = out[:, input_ids.shape[1] :]
            output_tokens += new_tokens.numel()
            if not first_ids:
                first_ids = new_tokens[0, :16].tolist()
    elapsed = time.perf_counter() - start
    input_tokens = args.num_prompts * args.input_len
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB / GIB

    result = {
        "engine": "transformers",
        "version": transformers.__version__,
        "torch": torch.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        # transformers picks these kernels itself; record them since they set the speed.
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "load_s": round(load_s, 2),
        **throughput_fields(args.num_prompts, input_tokens, output_tokens, elapsed),
        "peak_rss_gib": peak_rss,
        "first_output_ids": first_ids,
        "env": {k: v for k, v in os.environ.items() if k.startswith("OMP_")},
    }
    print(
        f"transformers {transformers.__version__}: {args.num_prompts} prompts x "
        f"{args.input_len} in / {args.output_len} out, batch {args.batch_size}, in "
        f"{elapsed:.2f} s (load {load_s:.1f} s)\n"
        f"  requests/s {result['requests_per_s']:.3f}  output tok/s "
        f"{result['output_tokens_per_s']:.1f}  total tok/s {result['total_tokens_per_s']:.1f}\n"
        f"  peak RSS GiB {peak_rss:.2f}\n"
        f"  first output ids: {first_ids}"
    )
    write_result_json(args.output_json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
