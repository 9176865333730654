"""MoE grouped GEMM kernels (bf16 and FP8 W8A8, contiguous and masked layouts) against their
torch twins, on DeepSeek-V3's expert structure scaled down: K = 7168 -> 512/256, N = 2048 ->
256, the 128-wide FP8 scale blocks kept. Padding rows hold NaN to prove they are never read.

Tolerance. Kernel and twin both form fp32 sums of exact products (bf16 x bf16 and fp8 x fp8
products fit in fp32; the twin's dequantized operands add one fp32 rounding each), in
different orders, so their fp32 results differ by at most ``2 (K + 2) u32 |x| @ |w|.T``
(the classic gamma_K bound, ``u32 = 2**-24``; Hopper's reduced-precision fp8 accumulation
stays inside it, as it spans one 128-wide group). The kernel then converts to bf16 once: on
a GPU rounding to nearest, at most ``2**-8`` relative; Triton's CPU interpreter truncates
instead (3.9), at most one ulp, ``2**-7``. So ``|out - exact| <= r (|exact| + acc) + acc``
with ``exact`` the twin's unrounded fp32 result: one bf16 conversion, no slack beyond that.
"""

from __future__ import annotations

import pytest
import torch

from widellm.layers.moe.dispatch_ep import sort_by_destination
from widellm.ops.triton_grouped_gemm import (
    CONTIGUOUS_BLOCK_M,
    contiguous_tiles,
    expert_offsets,
    grouped_gemm_contiguous,
    grouped_gemm_contiguous_reference,
    grouped_gemm_masked,
    grouped_gemm_masked_reference,
)
from widellm.ops.triton_grouped_gemm_fp8 import (
    FP8_DTYPE,
    dequantize_token_groups_reference,
    dequantize_weight_blocks_reference,
    grouped_gemm_fp8_contiguous,
    grouped_gemm_fp8_contiguous_reference,
    grouped_gemm_fp8_masked,
    grouped_gemm_fp8_masked_reference,
)

FP32_UNIT_ROUNDOFF = 2.0**-24
# Relative error of one fp32 -> bf16 conversion (8-bit significand): half an ulp when
# rounding to nearest (GPUs), a whole one when truncating (the interpreter).
BF16_CONVERSION_ERROR = 2.0**-8 if torch.cuda.is_available() else 2.0**-7
# Extra fp32 roundings per product in the FP8 twin (dequantizing each operand).
DEQUANT_ROUNDINGS = 2
FP8_GROUP = 128
# Rows after the last expert's in contiguous buffers (what sort_by_destination leaves for
# dropped -1 pairs); they hold NaN too.
TAIL_PADDING_ROWS = 5
WEIGHT_STD = 0.05
# FP8 test data: values spread over e4m3's range, scales of both signs' magnitudes apart.
FP8_VALUE_STD = 8.0
FP8_MAX = 448.0
# float8_e4m3fn's NaN bit pattern (S.1111.111); torch has no masked fill for fp8.
FP8_NAN_BITS = 0x7F

# (name, rows per expert, K, N): DeepSeek-V3's experts scaled down, empty and single-row
# experts, a skewed load (one expert with most rows, several tiles), partial N tiles with a
# partial 128-column weight-scale block, and nothing routed at all.
CONTIGUOUS_CASES = [
    ("deepseek_scaled", [70, 0, 1, 9], 512, 256),
    ("skewed", [3, 150, 0, 1], 256, 256),
    ("ragged_n", [17, 33], 384, 320),
    ("all_empty", [0, 0, 0], 128, 128),
]
# (name, counts, capacity, K, N): counts 0..C (and one past C, read as C); capacities giving
# one 32-row tile and two 64-row tiles per expert.
MASKED_CASES = [
    ("decode_small", [0, 1, 24, 7], 24, 512, 256),
    ("two_tiles", [80, 65, 0, 3], 80, 256, 256),
    ("over_capacity", [13, 19, 0], 16, 256, 128),
]


def assert_within_rounding(out: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor,
                           k: int) -> None:
    """out (bf16 kernel result) within one bf16 conversion of exact (fp32 twin), given
    magnitude = |x| @ |w|.T (see the module docstring)."""
    accum = 2 * (k + DEQUANT_ROUNDINGS) * FP32_UNIT_ROUNDOFF * magnitude
    bound = BF16_CONVERSION_ERROR * (exact.abs() + accum) + accum
    err = (out.float() - exact).abs()
    # NaN compares false: a NaN output fails here.
    assert bool((err <= bound).all()), f"max error {err.max()}, excess {(err - bound).max()}"


def _bf16(shape, device, std=1.0) -> torch.Tensor:
    return (torch.randn(shape, device=device) * std).to(torch.bfloat16)


def _fp8(shape, device) -> torch.Tensor:
    values = torch.randn(shape, device=device) * FP8_VALUE_STD
    return values.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _scales(shape, device) -> torch.Tensor:
    """Positive fp32 scales over two orders of magnitude."""
    return torch.rand(shape, device=device) * 0.1 + 0.001


def _contiguous_inputs(counts, k, n, device, fp8):
    offsets = expert_offsets(torch.tensor(counts, device=device))
    rows = sum(counts) + TAIL_PADDING_ROWS
    if fp8:
        x, w = _fp8((rows, k), device), _fp8((len(counts), n, k), device)
        x_scale = _scales((rows, -(-k // FP8_GROUP)), device)
        w_scale = _scales((len(counts), -(-n // FP8_GROUP), -(-k // FP8_GROUP)), device)
        x.view(torch.uint8)[sum(counts):] = FP8_NAN_BITS
        x_scale[sum(counts):] = float("nan")
        assert bool(x[sum(counts):].float().isnan().all())
        return x, x_scale, offsets, w, w_scale
    x, w = _bf16((rows, k), device), _bf16((len(counts), n, k), device, WEIGHT_STD)
    x[sum(counts):] = float("nan")
    return x, offsets, w


def _masked_inputs(counts, capacity, k, n, device, fp8):
    num_experts = len(counts)
    count_t = torch.tensor(counts, device=device)
    padding = torch.arange(capacity, device=device)[None, :] >= count_t[:, None]  # [E, C]
    if fp8:
        x, w = _fp8((num_experts, capacity, k), device), _fp8((num_experts, n, k), device)
        x_scale = _scales((num_experts, capacity, -(-k // FP8_GROUP)), device)
        w_scale = _scales((num_experts, -(-n // FP8_GROUP), -(-k // FP8_GROUP)), device)
        x.view(torch.uint8)[padding] = FP8_NAN_BITS
        x_scale[padding] = float("nan")
        assert bool(x[padding].float().isnan().all())
        return x, x_scale, count_t, w, w_scale
    x, w = _bf16((num_experts, capacity, k), device), _bf16((num_experts, n, k), device, WEIGHT_STD)
    x[padding] = float("nan")
    return x, count_t, w


@pytest.mark.parametrize("name,counts,k,n", CONTIGUOUS_CASES, ids=[c[0] for c in CONTIGUOUS_CASES])
def test_contiguous_bf16_matches_twin(device, name, counts, k, n):
    torch.manual_seed(0)
    x, offsets, w = _contiguous_inputs(counts, k, n, device, fp8=False)
    out = grouped_gemm_contiguous(x, offsets, w)
    assert out.shape == (x.shape[0], n) and out.dtype == torch.bfloat16
    exact = grouped_gemm_contiguous_reference(x, offsets, w, torch.float32)
    magnitude = grouped_gemm_contiguous_reference(x.abs(), offsets, w.abs(), torch.float32)
    assert_within_rounding(out, exact, magnitude, k)
    # The NaN rows no expert owns come out zero, exactly.
    assert torch.equal(out[sum(counts):], torch.zeros_like(out[sum(counts):]))


@pytest.mark.parametrize("name,counts,k,n", CONTIGUOUS_CASES, ids=[c[0] for c in CONTIGUOUS_CASES])
def test_contiguous_fp8_matches_twin(device, name, counts, k, n):
    torch.manual_seed(1)
    x, x_scale, offsets, w, w_scale = _contiguous_inputs(counts, k, n, device, fp8=True)
    out = grouped_gemm_fp8_contiguous(x, x_scale, offsets, w, w_scale)
    assert out.shape == (x.shape[0], n) and out.dtype == torch.bfloat16
    exact = grouped_gemm_fp8_contiguous_reference(x, x_scale, offsets, w, w_scale, torch.float32)
    x_deq = dequantize_token_groups_reference(x, x_scale)
    w_deq = dequantize_weight_blocks_reference(w, w_scale)
    magnitude = grouped_gemm_contiguous_reference(x_deq.abs(), offsets, w_deq.abs(), torch.float32)
    assert_within_rounding(out, exact, magnitude, k)
    assert torch.equal(out[sum(counts):], torch.zeros_like(out[sum(counts):]))


@pytest.mark.parametrize("name,counts,capacity,k,n", MASKED_CASES, ids=[c[0] for c in MASKED_CASES])
def test_masked_bf16_matches_twin(device, name, counts, capacity, k, n):
    torch.manual_seed(2)
    x, count_t, w = _masked_inputs(counts, capacity, k, n, device, fp8=False)
    out = grouped_gemm_masked(x, count_t, w)
    assert out.shape == (len(counts), capacity, n) and out.dtype == torch.bfloat16
    exact = grouped_gemm_masked_reference(x, count_t, w, torch.float32)
    magnitude = grouped_gemm_masked_reference(x.abs(), count_t, w.abs(), torch.float32)
    assert_within_rounding(out, exact, magnitude, k)  # padded rows: exact is 0, bound is 0


@pytest.mark.parametrize("name,counts,capacity,k,n", MASKED_CASES, ids=[c[0] for c in MASKED_CASES])
def test_masked_fp8_matches_twin(device, name, counts, capacity, k, n):
    torch.manual_seed(3)
    x, x_scale, count_t, w, w_scale = _masked_inputs(counts, capacity, k, n, device, fp8=True)
    out = grouped_gemm_fp8_masked(x, x_scale, count_t, w, w_scale)
    assert out.shape == (len(counts), capacity, n) and out.dtype == torch.bfloat16
    exact = grouped_gemm_fp8_masked_reference(x, x_scale, count_t, w, w_scale, torch.float32)
    x_deq = dequantize_token_groups_reference(x, x_scale)
    w_deq = dequantize_weight_blocks_reference(w, w_scale)
    magnitude = grouped_gemm_masked_reference(x_deq.abs(), count_t, w_deq.abs(), torch.float32)
    assert_within_rounding(out, exact, magnitude, k)


def test_contiguous_tiles_cover_each_row_once():
    """Every owned row lies in exactly one tile of its own expert; the list's tail is unused."""
    counts = torch.tensor([0, 1, 64, 65, 0, 130, 7])
    offsets = expert_offsets(counts)
    num_rows = int(counts.sum()) + TAIL_PADDING_ROWS
    tile_expert, row_start, row_end = contiguous_tiles(offsets, num_rows, CONTIGUOUS_BLOCK_M)
    covered = torch.zeros(num_rows, dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(counts)), counts)
    for expert, start, end in zip(tile_expert.tolist(), row_start.tolist(), row_end.tolist()):
        if expert < 0:
            continue
        assert end == int(offsets[expert + 1]) and start < end
        rows = torch.arange(start, min(start + CONTIGUOUS_BLOCK_M, end))
        covered[rows] += 1
        assert bool((owner[rows] == expert).all())
    num_owned = int(counts.sum())
    assert torch.equal(covered[:num_owned], torch.ones(num_owned, dtype=torch.int64))
    assert int(covered[num_owned:].sum()) == 0


def test_routed_tokens_through_sort_and_contiguous_gemm(device):
    """topk_ids [T, k] with -1 padding -> sort_by_destination(ids, 1, E) (one 'rank' per
    expert) + expert_offsets -> contiguous GEMM; each pair checked against its own token times
    its own expert's weight, and the dropped -1 pairs (sorted last) come out zero."""
    torch.manual_seed(4)
    num_tokens, top_k, num_experts, k, n = 24, 4, 4, 256, 128
    # Skewed routing: expert 2 takes most pairs, expert 3 none.
    topk_ids = torch.multinomial(torch.tensor([0.2, 0.1, 0.7, 0.0]), num_tokens * top_k,
                                 replacement=True).view(num_tokens, top_k)
    topk_ids[::5, 1] = -1
    topk_ids = topk_ids.to(device)
    hidden = _bf16((num_tokens, k), device)
    w = _bf16((num_experts, n, k), device, WEIGHT_STD)

    order = sort_by_destination(topk_ids, 1, num_experts)
    offsets = expert_offsets(order.counts)
    out = grouped_gemm_contiguous(hidden[order.order // top_k], offsets, w)

    flat_ids = topk_ids.reshape(-1)[order.order]
    num_valid = int(offsets[-1])
    assert num_valid == int((topk_ids >= 0).sum())
    tokens = hidden[order.order[:num_valid] // top_k].float()
    experts_w = w[flat_ids[:num_valid]].float()  # [num_valid, N, K]
    exact = torch.einsum("rk,rnk->rn", tokens, experts_w)
    magnitude = torch.einsum("rk,rnk->rn", tokens.abs(), experts_w.abs())
    assert_within_rounding(out[:num_valid], exact, magnitude, k)
    assert torch.equal(out[num_valid:], torch.zeros_like(out[num_valid:]))
