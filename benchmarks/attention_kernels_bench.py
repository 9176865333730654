"""Microbenchmark of the CPU attention kernels of Llama-family layers against the paths they
replace, both cores, SmolLM2-135M's shapes (9 query heads, 3 KV heads, head size 64).

Decode: ``paged_decode_attention`` on bf16 caches, its AVX512-BF16 path (where the CPU has it)
against its fp32 vector path (``bf16_dot=False``) and the gather + SDPA form; and on fp32
caches (the dtype of CPUs without native bf16), the vector path against gather + SDPA; with
30 layers' worth of caches visited in turn (as a decode step does, so the cache does not stay
in L3). Prefill: the causal kernel in bf16 (its AMX path where the CPU has AMX, and its
AVX512-BF16 vector path, ``allow_amx=False``) and in fp32 (its AVX2 path), with every prompt in
one ``prefill_attention_batch`` call (as the layers call it) and one ``prefill_attention`` call
per prompt, against torch SDPA (the layers' reference path), for SmolLM2 prompts and for MLA's
expanded prefill shape (deepseek-v3-small: 16 heads, 192 / 128)::

    .venv/bin/python benchmarks/attention_kernels_bench.py [--output-json FILE]

An AVX2 machine's paths on an AVX-512 one: build the kernels for x86-64-v3 and hold torch's own
kernels (SDPA) and oneDNN to AVX2 as well::

    WIDELLM_CPU_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        .venv/bin/python benchmarks/attention_kernels_bench.py

Each case: warm-up, then the best of ``--repeats`` means over ``--iters`` calls, paths
interleaved so the machine's drift hits all of them alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench_common import write_result_json
from cpu_kernels_bench import best_ms, parse_bench_args, times_text
from widellm.ops.cpu_attention import paged_decode_attention_reference
from widellm.ops.cpu_kernels import load_cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def decode_cases(args, kernels, dtype: torch.dtype, bf16_dot: bool) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for seqs, length in ((16, 290), (64, 150), (64, 600)):
        blocks = -(-length // BLOCK)
        num_blocks = seqs * blocks + 1
        caches = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
                  for _ in range(LAYERS)]
        bt = torch.randperm(num_blocks, generator=g)[: seqs * blocks].view(seqs, blocks)
        lens = torch.full((seqs,), length, dtype=torch.int64)
        q = torch.randn(seqs, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        turn = {"i": 0}

        def next_cache():
            turn["i"] += 1
            return caches[turn["i"] % LAYERS]

        def run(**kw):
            c = next_cache()
            return kernels.paged_decode_attention(q, c[0], c[1], bt, lens, 0.125, **kw)

        fns = {
            **({"avx512_bf16": run} if bf16_dot else {}),
            "vector": lambda: run(bf16_dot=False),
            "gather+sdpa": lambda: (c := next_cache(),
                                    paged_decode_attention_reference(q, c[0], c[1], bt, lens,
                                                                     0.125)),
        }
        times = best_ms(fns, args.iters, args.repeats)
        out.append({"kernel": "paged_decode_attention", "dtype": str(dtype), "seqs": seqs,
                    "len": length, "ms": times})
        print(f"decode {str(dtype):14s} seqs={seqs:3d} len={length:4d} " + times_text(times, 3),
              flush=True)
    return out


def prefill_cases(args, kernels, dtype: torch.dtype) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    # (prompts, tokens, heads, kv heads, key size, value size)
    for n, L, H, Hkv, dk, dv in ((16, 256, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM),
                                 (64, 128, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM),
                                 (1, 2048, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM),
                                 (16, 128, 16, 16, 192, 128)):
        backend = kernels.prefill_attention_backend(dk, dv, dtype)
        if backend == "none":
            continue
        q_all = torch.randn(n * L, H, dk, generator=g).to(dtype)
        qs = list(q_all.split(L))
        ks = [torch.randn(L, Hkv, dk, generator=g).to(dtype) for _ in range(n)]
        vs = [torch.randn(L, Hkv, dv, generator=g).to(dtype) for _ in range(n)]
        o = torch.empty(L, H, dv, dtype=dtype)
        o_all = torch.empty(n * L, H, dv, dtype=dtype)
        starts = [i * L for i in range(n + 1)]

        def kernel(allow_amx=True):  # one call per prompt
            for q, k, v in zip(qs, ks, vs):
                kernels.prefill_attention(q, k, v, o, dk ** -0.5, allow_amx=allow_amx)

        def batch(allow_amx=True):  # every prompt in one call, as the layers call it
            kernels.prefill_attention_batch(q_all, o_all, ks, vs, starts, dk ** -0.5,
                                            allow_amx=allow_amx)

        def sdpa():  # as the layers call it: causal, GQA in SDPA (MLA pads v to dk)
            for q, k, v in zip(qs, ks, vs):
                if dv != dk:
                    v = F.pad(v, (0, dk - dv))
                F.scaled_dot_product_attention(
                    q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=dk ** -0.5,
                    enable_gqa=True)

        fns = {"vector_batch": lambda: batch(False), "vector_per_prompt": lambda: kernel(False)}
        if backend == "amx":
            fns = {"amx_batch": batch, "amx_per_prompt": kernel, **fns}
        times = best_ms({**fns, "sdpa": sdpa}, args.iters, args.repeats)
        out.append({"kernel": "prefill_attention", "dtype": str(dtype), "prompts": n, "len": L,
                    "heads": H, "kv_heads": Hkv, "dk": dk, "dv": dv, "ms": times})
        print(f"prefill {str(dtype):14s} {n:3d} x {L:5d} H={H:2d}/{Hkv:2d} d={dk}/{dv} "
              + times_text(times), flush=True)
    return out


def main() -> None:
    args = parse_bench_args(__doc__)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("needs widellm's CPU kernels")
    bf16_dot = kernels.paged_decode_attention_backend(
        BLOCK, HEADS // KV_HEADS, HEAD_DIM, HEAD_DIM) == "avx512_bf16"
    results = {"decode": decode_cases(args, kernels, torch.bfloat16, bf16_dot)
               + decode_cases(args, kernels, torch.float32, False)}
    results["prefill"] = [case for dtype in (torch.bfloat16, torch.float32)
                          for case in prefill_cases(args, kernels, dtype)]
    if args.output_json:
        write_result_json(args.output_json, results)


if __name__ == "__main__":
    main()
