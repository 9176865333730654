"""Kernel rates on one CUDA GPU, for issue 25's goals (run by benchmarks/gpu/check.sh):

- HBM copy bandwidth (the roofline's denominator): a 2 GiB device-to-device copy.
- bf16 dense matmul rate (torch / cuBLAS), DeepSeek-V3's expert shape.
- The Triton MoE grouped GEMM, masked layout (decode), bf16 and FP8 W8A8 with 128 x 128 block
  scales, on one EP32 rank's experts (256 / 32 = 8 routed experts, K = 7168, N = 2 x 2048 for
  gate+up), 64-256 rows per expert; the goal is FP8 >= 50% of 2 x the bf16 matmul rate.
- Paged decode attention and MLA decode: bytes of KV read per call over the copy bandwidth.

Usage: python benchmarks/gpu/kernel_rates.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch

from widellm.model.fp8 import quantize_weight_block_fp8
from widellm.ops.triton_grouped_gemm import grouped_gemm_masked
from widellm.ops.triton_grouped_gemm_fp8 import grouped_gemm_fp8_masked
from widellm.ops.triton_mla_decode import mla_decode_attention
from widellm.ops.triton_paged_decode import paged_decode_attention
from widellm.ops.triton_silu_mul_quant import per_token_group_quant

GIB = 1 << 30
HIDDEN, MOE_INTER, LOCAL_EXPERTS = 7168, 2048, 8  # DeepSeek-V3, one rank of EP32
KV_LORA, ROPE, MLA_HEADS = 512, 64, 128
BLOCK = 64
WARMUP, ITERS = 5, 20


def timed(fn) -> float:
    """Median-free mean seconds of ``fn`` over ITERS after WARMUP, with CUDA events."""
    for _ in range(WARMUP):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / ITERS


def copy_bandwidth() -> float:
    src = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src))  # read + write, bytes/s


def matmul_rate() -> float:
    a = torch.randn(4096, HIDDEN, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(2 * MOE_INTER, HIDDEN, dtype=torch.bfloat16, device="cuda")
    return 2 * a.shape[0] * b.shape[0] * HIDDEN / timed(lambda: a @ b.T)


def grouped_rates(rows: int) -> dict:
    x = torch.randn(LOCAL_EXPERTS, rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(LOCAL_EXPERTS, 2 * MOE_INTER, HIDDEN, device="cuda") * 0.02
    counts = torch.full((LOCAL_EXPERTS,), rows, dtype=torch.int32, device="cuda")
    flops = 2 * LOCAL_EXPERTS * rows * 2 * MOE_INTER * HIDDEN
    wb = w.to(torch.bfloat16)
    bf16 = flops / timed(lambda: grouped_gemm_masked(x, counts, wb))
    qw = [quantize_weight_block_fp8(w[e]) for e in range(LOCAL_EXPERTS)]
    wq = torch.stack([q for q, _ in qw])
    ws = torch.stack([s for _, s in qw])
    xq, xs = per_token_group_quant(x.view(-1, HIDDEN))
    xq, xs = xq.view(LOCAL_EXPERTS, rows, HIDDEN), xs.view(LOCAL_EXPERTS, rows, -1)
    fp8 = flops / timed(lambda: grouped_gemm_fp8_masked(xq, xs, counts, wq, ws))
    return {"rows_per_expert": rows, "bf16_flops": bf16, "fp8_flops": fp8}


def decode_rates(batch: int, seq_len: int, bandwidth: float) -> dict:
    blocks_per_seq = seq_len // BLOCK
    table = torch.arange(batch * blocks_per_seq, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    cache = torch.randn(batch * blocks_per_seq, BLOCK, KV_LORA + ROPE, dtype=torch.bfloat16,
                        device="cuda")
    q = torch.randn(batch, MLA_HEADS, KV_LORA + ROPE, dtype=torch.bfloat16, device="cuda")
    t_mla = timed(lambda: mla_decode_attention(q, cache, table, lens, KV_LORA, 0.1))
    k = torch.randn(batch * blocks_per_seq, BLOCK, 8, 128, dtype=torch.bfloat16, device="cuda")
    qg = torch.randn(batch, 64, 128, dtype=torch.bfloat16, device="cuda")
    t_paged = timed(lambda: paged_decode_attention(qg, k, k, table, lens, 0.1))
    return {"batch": batch, "seq_len": seq_len,
            "mla_roofline_share": cache.numel() * 2 / t_mla / bandwidth,
            "paged_roofline_share": 2 * k.numel() * 2 / t_paged / bandwidth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_rates.py needs a CUDA GPU")
    bandwidth = copy_bandwidth()
    result = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bandwidth,
              "bf16_matmul_flops": matmul_rate()}
    result["grouped"] = [grouped_rates(rows) for rows in (64, 128, 256)]
    for g in result["grouped"]:
        g["fp8_vs_2x_bf16_matmul"] = g["fp8_flops"] / (2 * result["bf16_matmul_flops"])
    result["decode"] = [decode_rates(b, 2048, bandwidth) for b in (64, 256)]
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
