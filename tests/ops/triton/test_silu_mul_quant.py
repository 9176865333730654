"""The fused SiLU-and-mul and per-token-group FP8 kernels (widellm/ops/triton_silu_mul_quant.py)
against their torch twins.

Exactness, and where it stops: the quantization is plain IEEE arithmetic (max, exact divisions,
a round-to-nearest-even cast), so q and scales are bit-equal to the twin's for a given fp32
input. The activation's exp is not: the kernel's tl.exp (numpy's in the interpreter,
ex2.approx-based on NVIDIA) and torch's differ by a few fp32 ulps. So the fused kernel is
checked bit-exactly against the twin's quantization of the kernel's own fp32 activation, and
against the twin's from-scratch result with q bit-equal except where the twin's value / scale
lies within that exp error of an e4m3 rounding boundary (there one e4m3 step either way).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from widellm.layers.activation import silu_and_mul_reference as engine_silu_and_mul
from widellm.ops.triton_silu_mul_quant import (
    AMAX_EPSILON, FP8_E4M3_MAX, QUANT_GROUP_SIZE, per_token_group_quant,
    per_token_group_quant_reference, silu_and_mul, silu_and_mul_fp32_reference,
    silu_and_mul_quant, silu_and_mul_quant_reference, silu_and_mul_reference,
)

# Outlier gates of -100 and below overflow exp(-gate) to inf, as intended (silu -> -0); the
# interpreter's numpy says so each time.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.bfloat16, torch.float32]
# (T, I): no rows, one row, a partial 16-row tile, DeepSeek-V3's moe_intermediate_size on a
# few rows (the interpreter runs each program in Python), one full and one partial group.
SHAPES = [(0, 128), (1, 128), (7, 256), (2, 2048), (5, 200)]
# On CUDA both roundings run (the default, hardware cvt on Ada/Hopper, and the integer one the
# interpreter needs); elsewhere the default is the integer one.
ROUNDINGS = [None, True] if torch.cuda.is_available() else [None]
# Relative difference of the kernel's fp32 silu from torch's: exp via ex2.approx(x * log2 e)
# on NVIDIA loses the product's rounding, ~2^-17 relative near |x| = 88 where fp32 exp
# overflows, plus ex2.approx's 2 ulps; numpy's exp is within 1 ulp of torch's.
EXP_RTOL = 2.0 ** -16
# exp(-gate) overflows to inf near gate = -88.72 in both, at points that may differ by an ulp:
# silu there is -0 against ~-1e-37 (times up).
SILU_OVERFLOW_ATOL = 1e-30
# One bf16 step relative to the value (7 stored mantissa bits): an exp ulp may flip a rounding.
BF16_STEP = 2.0 ** -7
# The engine's bf16 SiLU-and-mul rounds silu(gate) and then the product: two half steps more.
ENGINE_BF16_RTOL = 2.0 ** -6
# e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself, a
# subnormal one (below 2^-6, steps of 2^-9) by at most 2^-10 in units of the scale.
E4M3_HALF_STEP_REL = 2.0 ** -4
E4M3_HALF_SUBNORMAL_STEP = 2.0 ** -10
# Inputs: normal values with outliers (a few far larger ones) dominating some groups.
INPUT_STD = 2.0
OUTLIER_EVERY = 97
OUTLIER_GAIN = 40.0


def _activations(num_tokens: int, width: int, dtype: torch.dtype, device, seed: int = 0,
                 ) -> torch.Tensor:
    """[num_tokens, width] normal values with outliers and, where there are 2+ groups, one
    all-zero group in row 0 of the second half (an all-zero `up` group in the fused case)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, width, generator=g) * INPUT_STD
    x.view(-1)[::OUTLIER_EVERY] *= OUTLIER_GAIN
    if num_tokens and width >= 4 * QUANT_GROUP_SIZE:
        x[0, width // 2:width // 2 + QUANT_GROUP_SIZE] = 0.0
    return x.to(dtype).to(device)


def _assert_fp8_equal(q, scales, q_ref, scales_ref) -> None:
    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert q.shape == q_ref.shape and scales.shape == scales_ref.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scales, scales_ref)


def _assert_fp8_matches_exact_value(q, scales, value, group_size=QUANT_GROUP_SIZE) -> None:
    """q [T, I], scales [T, I/g] against the twin's exact fp32 value [T, I]: scales within
    EXP_RTOL, q bit-equal to the twin's rounding of value / scale except within EXP_RTOL of a
    rounding boundary, and q * scale within half an e4m3 step of value."""
    _, scales_ref = per_token_group_quant_reference(value, group_size=group_size)
    torch.testing.assert_close(scales, scales_ref, rtol=EXP_RTOL, atol=0.0)
    fill = scales.shape[-1] * group_size - value.shape[-1]  # a partial last group's zeros

    def as_groups(t):
        return F.pad(t, (0, fill)).view(*scales.shape, group_size)

    groups = as_groups(value)
    y = groups / scales_ref[..., None]

    def e4m3(v):
        return v.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    low, high = e4m3(y * (1 - EXP_RTOL)), e4m3(y * (1 + EXP_RTOL))
    bits = as_groups(q.view(torch.uint8))
    assert torch.equal(bits[low == high], e4m3(y)[low == high])
    assert ((bits == low) | (bits == high)).all()

    deq = as_groups(q.float()) * scales[..., None]
    bound = torch.maximum(groups.abs() * E4M3_HALF_STEP_REL,
                          scales[..., None] * E4M3_HALF_SUBNORMAL_STEP)
    assert ((deq - groups).abs() <= bound * (1 + EXP_RTOL)).all()


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("num_tokens, inter", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_twin(device, dtype, num_tokens, inter, rounding):
    x = _activations(num_tokens, 2 * inter, dtype, device)
    out = silu_and_mul(x, software_rounding=rounding)
    ref = silu_and_mul_reference(x)
    assert out.dtype == dtype and out.shape == (num_tokens, inter)
    rtol = BF16_STEP if dtype == torch.bfloat16 else EXP_RTOL
    torch.testing.assert_close(out, ref, rtol=rtol, atol=SILU_OVERFLOW_ATOL)
    # The engine's CPU op (bf16 rounded twice) agrees within its own rounding.
    engine_rtol = ENGINE_BF16_RTOL if dtype == torch.bfloat16 else EXP_RTOL
    torch.testing.assert_close(out, engine_silu_and_mul(x), rtol=engine_rtol,
                               atol=SILU_OVERFLOW_ATOL)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("num_tokens, inter", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_quant_matches_twin(device, dtype, num_tokens, inter, rounding):
    x = _activations(num_tokens, 2 * inter, dtype, device)
    q, scales = silu_and_mul_quant(x, software_rounding=rounding)
    assert scales.shape == (num_tokens, -(-inter // QUANT_GROUP_SIZE))
    # Bit-exact: the twin's quantization of the kernel's own fp32 activation.
    own = silu_and_mul(x, out_dtype=torch.float32, software_rounding=rounding)
    _assert_fp8_equal(q, scales, *per_token_group_quant_reference(own))
    # Against the twin from scratch (its exp, not the kernel's).
    _assert_fp8_matches_exact_value(q, scales, silu_and_mul_fp32_reference(x))
    q_ref, _ = silu_and_mul_quant_reference(x)
    assert q.shape == q_ref.shape


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("num_tokens, width", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_per_token_group_quant_matches_twin(device, dtype, num_tokens, width, rounding):
    """No exp here: q and scales are bit-equal to the twin's; the all-zero group gets the
    epsilon scale."""
    x = _activations(num_tokens, width, dtype, device, seed=1)
    q, scales = per_token_group_quant(x, software_rounding=rounding)
    _assert_fp8_equal(q, scales, *per_token_group_quant_reference(x))
    if num_tokens and width >= 4 * QUANT_GROUP_SIZE:
        zero_group = width // 2 // QUANT_GROUP_SIZE
        eps_scale = torch.tensor(AMAX_EPSILON) / FP8_E4M3_MAX
        assert scales[0, zero_group].item() == eps_scale.item()
        assert not q[0, width // 2:width // 2 + QUANT_GROUP_SIZE].view(torch.uint8).any()


def _e4m3_rounding_edges() -> torch.Tensor:
    """fp32 values at and around every rounding boundary of e4m3 (ties between neighbours,
    one fp32 ulp either side, the subnormal range, the carries into the next binade), both
    signs, in rows whose first value is 448 so that the scale is exactly 1."""
    codes = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = (codes[:-1] + codes[1:]) / 2  # exact in fp32
    above = torch.nextafter(ties, torch.full_like(ties, float("inf")))
    below = torch.nextafter(ties, torch.zeros_like(ties))
    values = torch.cat([codes, ties, above, below, torch.tensor([FP8_E4M3_MAX, 2.0 ** -12])])
    values = torch.cat([values, -values])
    per_row = QUANT_GROUP_SIZE - 1
    values = torch.cat([values, values[: (-values.numel()) % per_row]])
    rows = values.view(-1, per_row)
    return torch.cat([torch.full((rows.shape[0], 1), FP8_E4M3_MAX), rows], dim=1)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_group_quant_rounds_every_e4m3_boundary_like_torch(device, rounding):
    """Round to nearest even at every tie (normal and subnormal), carries across binades, and
    the largest value: bit-equal to torch's own float8_e4m3fn cast."""
    x = _e4m3_rounding_edges().to(device)
    q, scales = per_token_group_quant(x, software_rounding=rounding)
    assert (scales == 1.0).all()
    assert torch.equal(q.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("valid_as", ["int", "tensor", "row_ids", "counts", "all"])
def test_padding_rows_are_not_read_and_come_out_zero(device, valid_as):
    """Padding rows (past num_valid_rows, with a negative row id, or past their expert's count
    in the masked layout) hold NaN/inf garbage; the outputs there are those of a zero row (0;
    q 0 with the epsilon scale) and match the twins, over an [E, C, 2I] input of 20 rows (two
    16-row tiles)."""
    num_experts, rows_per_expert, inter = 2, 10, QUANT_GROUP_SIZE
    num_rows = num_experts * rows_per_expert
    x = _activations(num_rows, 2 * inter, torch.bfloat16, device)
    row_ids = torch.arange(num_rows, device=device).view(num_experts, rows_per_expert)
    row_ids[:, ::3] = -1  # DeepSeek's -1 rows, interleaved
    num_valid = 14  # a count past which rows are padding, as of a padded CUDA-graph batch
    counts = torch.tensor([7, 3], dtype=torch.int32, device=device)
    kwargs = {
        "int": dict(num_valid_rows=num_valid),
        "tensor": dict(num_valid_rows=torch.tensor([num_valid], device=device)),
        "row_ids": dict(row_ids=row_ids),
        "counts": dict(counts=counts),
        "all": dict(num_valid_rows=torch.tensor([num_valid], device=device), row_ids=row_ids,
                    counts=counts),
    }[valid_as]
    index = torch.arange(num_rows, device=device)
    pad = torch.zeros(num_rows, dtype=torch.bool, device=device)
    if "num_valid_rows" in kwargs:
        pad |= index >= num_valid
    if "row_ids" in kwargs:
        pad |= row_ids.reshape(-1) < 0
    if "counts" in kwargs:
        pad |= index % rows_per_expert >= counts.repeat_interleave(rows_per_expert)
    x[pad, ::2] = float("nan")
    x[pad, 1::2] = float("inf")
    x = x.view(num_experts, rows_per_expert, 2 * inter)

    out = silu_and_mul(x, **kwargs)
    assert out.shape == (num_experts, rows_per_expert, inter)
    torch.testing.assert_close(out, silu_and_mul_reference(x, **kwargs), rtol=BF16_STEP,
                               atol=0.0)
    assert not out.view(num_rows, inter)[pad].any()

    q, scales = silu_and_mul_quant(x, **kwargs)
    own = silu_and_mul(x, out_dtype=torch.float32, **kwargs)
    _assert_fp8_equal(q, scales, *per_token_group_quant_reference(own))
    _assert_fp8_matches_exact_value(q, scales, silu_and_mul_fp32_reference(x, **kwargs))
    q_direct, scales_direct = per_token_group_quant(x, **kwargs)
    _assert_fp8_equal(q_direct, scales_direct, *per_token_group_quant_reference(x, **kwargs))

    eps_scale = (torch.tensor(AMAX_EPSILON) / FP8_E4M3_MAX).item()
    for q_, scales_ in ((q, scales), (q_direct, scales_direct)):
        assert not q_.view(torch.uint8).view(num_rows, -1)[pad].any()
        assert (scales_.view(num_rows, -1)[pad] == eps_scale).all()
