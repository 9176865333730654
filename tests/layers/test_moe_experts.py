"""Grouped experts vs the masked-loop reference, and both vs a per-row formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from widellm.layers.activation import SiluAndMul, silu_and_mul, silu_and_mul_reference
from widellm.layers.moe.experts import (
    experts_forward, fused_experts_backend, grouped_experts_forward, masked_experts_forward,
    prefers_masked_layout, reference_experts_forward,
)

NUM_EXPERTS = 6
HIDDEN = 24
INTER = 10
NUM_ROWS = 41
# A few units in the last place at the outputs' magnitude (up to ~2): what another GEMM
# blocking can change, far below any real error (a wrong row or expert is off by ~0.1-1).
ULP_TOLERANCE = {torch.float32: dict(rtol=0, atol=8 * 2.0 ** -23),
                 torch.bfloat16: dict(rtol=0, atol=8 * 2.0 ** -7)}


def _weights(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * 0.2
    return w13.to(dtype), w2.to(dtype)


def _inputs(dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows routed to experts {0, 2, 5} only (1, 3, 4 stay empty), every 4th row skipped."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(NUM_ROWS, HIDDEN, generator=gen).to(dtype)
    used = torch.tensor([0, 2, 5])
    expert_ids = used[torch.randint(0, len(used), (NUM_ROWS,), generator=gen)]
    expert_ids[::4] = -1
    return hidden, expert_ids


def test_silu_and_mul_matches_hf_swiglu():
    x = torch.randn(7, 2 * INTER, generator=torch.Generator().manual_seed(2))
    expected = ACT2FN["silu"](x[:, :INTER]) * x[:, INTER:]
    assert torch.equal(silu_and_mul_reference(x), expected)
    # The CPU kernel (fp32 too) computes exp its own way: within fp32 rounding.
    torch.testing.assert_close(silu_and_mul(x), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(SiluAndMul()(x), silu_and_mul(x))
    assert SiluAndMul()(x).shape == (7, INTER)


def test_reference_matches_per_row_formula():
    w13, w2 = _weights(torch.float32)
    hidden, expert_ids = _inputs(torch.float32)
    out = reference_experts_forward(hidden, expert_ids, w13, w2)
    for row in range(NUM_ROWS):
        e = int(expert_ids[row])
        if e < 0:
            assert torch.equal(out[row], torch.zeros(HIDDEN))
            continue
        x = hidden[row]
        gate, up = w13[e, :INTER] @ x, w13[e, INTER:] @ x
        expected = w2[e] @ (F.silu(gate) * up)
        torch.testing.assert_close(out[row], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matches_reference(dtype):
    w13, w2 = _weights(dtype)
    hidden, expert_ids = _inputs(dtype)
    grouped = grouped_experts_forward(hidden, expert_ids, w13, w2)
    reference = reference_experts_forward(hidden, expert_ids, w13, w2)
    assert grouped.dtype == dtype and grouped.shape == (NUM_ROWS, HIDDEN)
    # Same rows per expert in the same order, but the grouped path pads each expert's slice to
    # a bucket of rows, and a BLAS may pick another kernel (another summation order) for
    # another row count: equal within a few units of the last place (bitwise on AMX/AVX-512
    # machines, 1-ulp differences in fp32 on AVX2 ones).
    torch.testing.assert_close(grouped, reference, **ULP_TOLERANCE[dtype])
    skipped = expert_ids < 0
    assert torch.equal(grouped[skipped], torch.zeros_like(grouped[skipped]))
    assert (grouped[~skipped].abs().sum(dim=-1) > 0).all()


def test_grouped_all_skipped_and_empty():
    w13, w2 = _weights(torch.float32)
    hidden = torch.randn(5, HIDDEN)
    out = grouped_experts_forward(hidden, torch.full((5,), -1), w13, w2)
    assert torch.equal(out, torch.zeros(5, HIDDEN))
    empty = grouped_experts_forward(hidden[:0], torch.zeros(0, dtype=torch.int64), w13, w2)
    assert empty.shape == (0, HIDDEN)


def test_grouped_rejects_out_of_range_expert():
    w13, w2 = _weights(torch.float32)
    for bad in (NUM_EXPERTS, NUM_EXPERTS + 1, NUM_EXPERTS + 5):
        with pytest.raises(ValueError):
            grouped_experts_forward(torch.randn(2, HIDDEN), torch.tensor([0, bad]), w13, w2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [3, 48, 200])
def test_masked_layout_matches_reference(dtype, num_rows):
    g = torch.Generator().manual_seed(num_rows)
    num_experts, hidden_size, inter = 8, 32, 16
    w13 = (torch.randn(num_experts, 2 * inter, hidden_size, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(num_experts, hidden_size, inter, generator=g) * 0.1).to(dtype)
    hidden = torch.randn(num_rows, hidden_size, generator=g).to(dtype)
    expert_ids = torch.randint(0, num_experts, (num_rows,), generator=g)
    expert_ids[::5] = -1  # padding rows
    expert_ids[expert_ids == 3] = 4  # an empty expert
    masked = masked_experts_forward(hidden, expert_ids, w13, w2)
    reference = reference_experts_forward(hidden, expert_ids, w13, w2)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(masked, reference, atol=tol, rtol=tol)
    assert torch.equal(masked[::5], torch.zeros_like(masked[::5]))
    if fused_experts_backend(hidden, w13) is None:  # bf16 may take the kernel (test_cpu_moe)
        assert torch.equal(experts_forward(hidden, expert_ids, w13, w2),
                           masked if prefers_masked_layout(expert_ids, num_experts) else
                           grouped_experts_forward(hidden, expert_ids, w13, w2))


def test_layout_choice_by_rows_per_expert_and_skew():
    num_experts = 8
    even = torch.arange(64) % num_experts  # 8 rows each: decode-like, masked
    assert prefers_masked_layout(even, num_experts)
    assert not prefers_masked_layout(even[:8], num_experts)  # 1 row each: too few
    assert not prefers_masked_layout(torch.arange(1024) % num_experts, num_experts)  # prefill
    # Same 64 rows, but one expert takes 40: the grid would be 8 x 64 = 512 rows for 64 real
    # ones (8x padding), so the contiguous layout is chosen.
    skewed = torch.cat([torch.zeros(40, dtype=torch.int64), torch.arange(24) % num_experts])
    assert not prefers_masked_layout(skewed, num_experts)
    # Padding rows (-1) count for nothing: a mostly empty fixed-capacity buffer is not decode.
    padded = torch.cat([even[:8], torch.full((56,), -1)])
    assert not prefers_masked_layout(padded, num_experts)
