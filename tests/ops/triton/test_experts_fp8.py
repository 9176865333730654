"""FP8 routed experts (``layers/moe/experts_fp8.py``, ``experts_triton.py``): the W8A8 sequence on the Triton kernels
(sort by expert, token-group quant, grouped GEMM, fused SiLU-and-mul + quant, grouped GEMM,
unsort) against the same sequence on the ops' torch twins, and both against the fp32 experts on
the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from widellm.layers.moe.experts import reference_experts_forward
from widellm.layers.linear_fp8 import dequantize_blocks
from widellm.layers.moe.experts_triton import triton_experts_forward
from widellm.model.fp8 import quantize_weight_block_fp8

BLOCK = (128, 128)
HIDDEN, INTER = 256, 128  # DeepSeek-V3's 7,168 / 2,048, scaled down; I on a block boundary
WEIGHT_STD = 0.05
FP8_STEP = 2**-3  # e4m3's largest relative rounding step (3 mantissa bits)
BF16_STEP = 2**-7  # one bf16 rounding of an output, relatively (with margin)
TINY = 1e-6
# (name, rows per local expert, skipped rows): DeepSeek-like spread with an empty expert, a
# skewed load (one expert with most rows), a lone row, and only skipped rows.
CASES = [
    ("spread", [9, 0, 4, 12], 3),
    ("skewed", [2, 70, 0, 1], 5),
    ("one_row", [0, 0, 1, 0], 0),
    ("all_skipped", [0, 0, 0, 0], 4),
]


def _quantized_experts(num_experts: int, rows: int, cols: int, device):
    """[E, rows, cols] float8 weights and their [E, rows/128, cols/128] scales."""
    qs, scales = zip(*(quantize_weight_block_fp8(torch.randn(rows, cols) * WEIGHT_STD)
                       for _ in range(num_experts)))
    return torch.stack(qs).to(device), torch.stack(scales).to(device)


def _inputs(counts, skipped, device):
    ids = [e for e, n in enumerate(counts) for _ in range(n)] + [-1] * skipped
    perm = torch.randperm(len(ids))  # routed rows arrive in any order
    expert_ids = torch.tensor(ids, dtype=torch.int64)[perm].to(device)
    hidden = torch.randn(len(ids), HIDDEN).to(torch.bfloat16).to(device)
    return hidden, expert_ids


@pytest.mark.parametrize("name,counts,skipped", CASES, ids=[c[0] for c in CASES])
def test_w8a8_experts_equal_their_twin(device, name, counts, skipped):
    torch.manual_seed(len(name))
    w13, w13_scale = _quantized_experts(len(counts), 2 * INTER, HIDDEN, device)
    w2, w2_scale = _quantized_experts(len(counts), HIDDEN, INTER, device)
    hidden, expert_ids = _inputs(counts, skipped, device)

    got = triton_experts_forward(hidden, expert_ids, w13, w2, w13_scale, w2_scale)
    twin = triton_experts_forward(hidden, expert_ids, w13, w2, w13_scale, w2_scale,
                                  reference=True)
    assert got.shape == twin.shape == (sum(counts) + skipped, HIDDEN)
    assert got.dtype == twin.dtype == torch.bfloat16
    skipped_rows = expert_ids < 0
    assert bool((got[skipped_rows] == 0).all()) and bool((twin[skipped_rows] == 0).all())
    w13_exact = dequantize_blocks(w13, w13_scale, BLOCK).cpu()
    w2_exact = dequantize_blocks(w2, w2_scale, BLOCK).cpu()
    exact = reference_experts_forward(hidden.float().cpu(), expert_ids.cpu(), w13_exact, w2_exact)
    # The first GEMM's bf16 outputs round differently in the kernel and the twin (their fp32
    # sums run in another order), and a value that moves by one bf16 step can cross an FP8
    # rounding boundary when the intermediate is quantized: each intermediate value may then
    # differ by one e4m3 step, at most 1/8 of itself. Bound per output element: 1/8 of
    # sum_i |intermediate_i| * |w2_ji|, plus the output's own bf16 rounding.
    magnitude = _down_magnitude(hidden.float().cpu(), expert_ids.cpu(), w13_exact, w2_exact)
    diff = (got.float() - twin.float()).abs().cpu()
    bound = FP8_STEP * magnitude + BF16_STEP * twin.float().abs().cpu() + TINY
    assert bool((diff <= bound).all()), f"excess {(diff - bound).max()}"
    # Against fp32 experts on the dequantized weights: within FP8's activation error (the rows
    # and the intermediate are each quantized once).
    scale = max(exact.abs().max().item(), TINY)
    assert (got.float().cpu() - exact).abs().max().item() <= FP8_STEP * scale


def _down_magnitude(hidden, expert_ids, w13, w2):
    """``[N, H]`` sum over i of |intermediate_i| * |w2[e]_ji| per row (0 for skipped rows)."""
    out = torch.zeros(hidden.shape[0], w2.shape[1])
    for row, expert in enumerate(expert_ids.tolist()):
        if expert < 0:
            continue
        gate, up = (hidden[row] @ w13[expert].T).chunk(2)
        out[row] = (torch.nn.functional.silu(gate) * up).abs() @ w2[expert].abs().T
    return out
