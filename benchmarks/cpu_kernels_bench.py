"""Microbenchmark of the AMX CPU kernels against the torch paths they replace, bf16, both cores.

Routed experts: ``fused_experts`` against the grouped (per-expert loop) and masked (``[E, P,
H]`` grid, the decode layout) paths of ``widellm/layers/moe/experts.py``, for one layer of the
deepseek-v3-small shapes (64 experts, hidden 1,024, intermediate 384, top-6) at decode and
prefill row counts, uniform and skewed (Dirichlet 0.3) routing. MLA decode:
``mla_decode_attention`` against the gather + absorbed-bmm form (``_decode_absorbed``) on a
paged latent cache, 16 heads, latent 512 + rope 64::

    .venv/bin/python benchmarks/cpu_kernels_bench.py [--output-json FILE]

Each case: warm-up, then the best of ``--repeats`` means over ``--iters`` calls, paths
interleaved so the machine's drift hits all of them alike. One layer's weights (151 MB) are
called again and again, so they are partly cache-resident (300 MB L3 here): the engine, which
walks through every layer's weights each step, sees less of the gap.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench_common import write_result_json
from widellm.layers.moe.experts import (
    fused_experts_forward, grouped_experts_forward, masked_experts_forward,
)
from widellm.ops.cpu_kernels import load_cpu_kernels

EXPERTS, HIDDEN, INTER, TOP_K = 64, 1024, 384, 6
HEADS, LORA, ROPE, BLOCK = 16, 512, 64, 16
MLA_LAYERS = 8  # deepseek-v3-small's layers


def best_ms(fns: dict, iters: int, repeats: int) -> dict[str, float]:
    """Best mean time per call (ms) of each function, the functions interleaved."""
    for f in fns.values():
        f()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            start = time.perf_counter()
            for _ in range(iters):
                f()
            best[name] = min(best[name], (time.perf_counter() - start) / iters * 1e3)
    return best


def parse_bench_args(doc: str, extra=None) -> argparse.Namespace:
    """--iters, --repeats and --output-json, shared by the kernel microbenchmarks; ``extra``
    (a function of the parser) adds a script's own flags."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-json", default=None)
    if extra is not None:
        extra(p)
    return p.parse_args()


def times_text(times: dict[str, float], digits: int = 2) -> str:
    return "  ".join(f"{k} {v:8.{digits}f} ms" for k, v in times.items())


def experts_cases(args) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.03).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.05).bfloat16()
    rows_list = [64 * TOP_K, 256 * TOP_K, 4096 * TOP_K]
    out = []
    for rows in rows_list:
        for skewed in (False, True):
            x = torch.randn(rows, HIDDEN, generator=g).bfloat16()
            if skewed:
                p = torch.distributions.Dirichlet(torch.full((EXPERTS,), 0.3)).sample()
                ids = torch.multinomial(p, rows, replacement=True, generator=g)
            else:
                ids = torch.randint(0, EXPERTS, (rows,), generator=g)
            fns = {
                "fused": lambda: fused_experts_forward(x, ids, w13, w2),
                "grouped": lambda: grouped_experts_forward(x, ids, w13, w2),
            }
            if rows <= 16 * EXPERTS:  # the masked grid is a decode layout
                fns["masked"] = lambda: masked_experts_forward(x, ids, w13, w2)
            iters = max(1, args.iters * 384 // rows)
            times = best_ms(fns, iters, args.repeats)
            out.append({"kernel": "fused_experts", "rows": rows, "skewed": skewed, "ms": times})
            print(f"experts rows={rows:6d} skewed={skewed!s:5s} " + times_text(times), flush=True)
    return out


def mla_cases(args) -> list[dict]:
    from torch import nn

    from widellm.layers.attention import gather_from_cache
    from widellm.layers.attention_metadata import DECODE_LEN_BUCKET
    from widellm.layers.mla import MLAAttention

    g = torch.Generator().manual_seed(1)
    nope, v_dim = 128, 128
    kv_b = nn.Linear(LORA, HEADS * (nope + v_dim), bias=False).to(torch.bfloat16)
    layer = MLAAttention(HEADS, nope, ROPE, v_dim, LORA, 0.07, kv_b)
    layer.process_weights_after_loading()
    kernels = load_cpu_kernels()
    out = []
    for seqs, mean_len in ((16, 290), (64, 150), (64, 600)):
        lens = torch.randint(1, 2 * mean_len, (seqs,), generator=g)
        max_blocks = int((lens.max() + BLOCK - 1) // BLOCK)
        num_blocks = seqs * max_blocks + 1
        # One cache per layer of deepseek-v3-small, visited in turn by the kernel as a decode
        # step does (one cache called repeatedly would stay in L2/L3); the gather form copies
        # its context out of the first.
        caches = [torch.randn(num_blocks, BLOCK, LORA + ROPE, generator=g).bfloat16()
                  for _ in range(MLA_LAYERS)]
        cache = caches[0]
        turn = iter(range(1 << 62))
        bt = torch.randperm(num_blocks, generator=g)[: seqs * max_blocks].view(seqs, max_blocks)
        q = (torch.randn(seqs, HEADS, nope + ROPE, generator=g) * 0.1).bfloat16()
        q_cat = layer._absorb_query(q).contiguous()
        # The gather form's inputs as the metadata builder makes them: lengths padded to its
        # bucket (few distinct GEMM shapes), padding masked; the gather is timed with it.
        max_len = -(-int(lens.max()) // DECODE_LEN_BUCKET) * DECODE_LEN_BUCKET
        pos = torch.arange(max_len)
        valid = pos[None, :] < lens[:, None]
        block_idx = (pos // BLOCK).clamp(max=max_blocks - 1)
        slots = torch.where(valid, bt[:, block_idx] * BLOCK + pos % BLOCK, 0)
        flat = cache.flatten(0, 1)
        mask = valid[:, None, None, :]
        fns = {
            "kernel": lambda: kernels.mla_decode_attention(
                q_cat, caches[next(turn) % MLA_LAYERS], bt, lens, LORA, 0.07),
            "gather+bmm": lambda: layer._decode_absorbed(q, gather_from_cache(flat, slots), mask),
        }
        times = best_ms(fns, args.iters, args.repeats)
        out.append({"kernel": "mla_decode_attention", "seqs": seqs, "mean_len": mean_len,
                    "ms": times})
        print(f"mla seqs={seqs:3d} mean_len={mean_len:4d} " + times_text(times), flush=True)
    return out


def main() -> None:
    args = parse_bench_args(__doc__)
    kernels = load_cpu_kernels()
    if kernels is None or kernels.fused_experts_backend(HIDDEN, INTER) != "amx":
        raise SystemExit("needs widellm's CPU kernels on a CPU with AMX")
    results = {"experts": experts_cases(args)}
    if kernels.mla_decode_supported(BLOCK, LORA + ROPE, LORA):
        results["mla"] = mla_cases(args)
    if args.output_json:
        write_result_json(args.output_json, results)


if __name__ == "__main__":
    main()
