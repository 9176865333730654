"""Microbenchmark of the elementwise CPU kernels of a Llama-family prefill step (RMSNorm, fused
residual add + RMSNorm, SiLU-and-mul, rotary) at SmolLM2-135M's widths, bf16, both cores::

    .venv/bin/python benchmarks/elementwise_bench.py [--rows 2048] [--output-json FILE]

To compare two versions of the kernels, run it from each checkout in turn (``PYTHONPATH=OTHER``
imports the other one's widellm; each builds its own extension), alternating a few times: the
machine's drift is larger than most kernel changes. Set ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0``
to allocate outputs as the engine does (no page faults per call).
"""

from __future__ import annotations

import torch

from bench_common import write_result_json
from cpu_kernels_bench import best_ms, parse_bench_args, times_text
from widellm.ops.cpu_kernels import load_cpu_kernels

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64
EPS = 1e-5
PROMPT_LEN = 256  # positions cycle over one prompt's length


def main() -> None:
    args = parse_bench_args(__doc__, extra=lambda p: p.add_argument("--rows", type=int,
                                                                    default=2048))
    k = load_cpu_kernels()
    if k is None:
        raise SystemExit("the CPU kernels are not available here")
    g = torch.Generator().manual_seed(0)
    T = args.rows

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).bfloat16()

    x, res, w = rand(T, HIDDEN), rand(T, HIDDEN), rand(HIDDEN)
    gate_up = rand(T, 2 * INTERMEDIATE)
    qkv = rand(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM)  # q and k are views into it, as in a layer
    q = qkv[:, : HEADS * HEAD_DIM].view(T, HEADS, HEAD_DIM)
    key = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(T, KV_HEADS, HEAD_DIM)
    positions = torch.arange(T, dtype=torch.int64) % PROMPT_LEN
    cos, sin = torch.randn(PROMPT_LEN, HEAD_DIM, generator=g), torch.randn(PROMPT_LEN, HEAD_DIM,
                                                                           generator=g)
    times = best_ms({
        "rms_norm": lambda: k.rms_norm(x, w, EPS),
        "fused_add_rms_norm": lambda: k.fused_add_rms_norm(x, res, w, EPS),
        "silu_and_mul": lambda: k.silu_and_mul(gate_up),
        "rotary_q": lambda: k.rotary_embedding(positions, q, cos, sin, False),
        "rotary_k": lambda: k.rotary_embedding(positions, key, cos, sin, False),
    }, args.iters, args.repeats)
    print(f"{T} rows: {times_text(times, 3)}")
    write_result_json(args.output_json, {"rows": T, "ms": times})


if __name__ == "__main__":
    main()
