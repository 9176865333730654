"""The fused routed-expert kernel (``ops/cpu/moe.cpp``) against the per-expert torch reference."""

from __future__ import annotations

import pytest
import torch

from widellm.layers.moe.experts import (
    DOT_KERNEL_MAX_ROWS_PER_EXPERT, experts_forward, fused_experts_backend, fused_experts_forward,
    reference_experts_forward,
)

pytestmark = pytest.mark.usefixtures("kernels")

NUM_EXPERTS = 8
HOT_EXPERT_ROWS = 37  # three 16-row tile chunks, the last one partial


def _case(hidden_size: int, inter: int, seed: int = 0):
    """bf16 weights and 80 rows: expert 2 takes 37 of them, 5 and 6 none, every 7th skipped."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(NUM_EXPERTS, 2 * inter, hidden_size, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(NUM_EXPERTS, hidden_size, inter, generator=g) * 0.1).bfloat16()
    hidden = torch.randn(80, hidden_size, generator=g).bfloat16()
    others = torch.tensor([0, 1, 3, 4, 7])
    expert_ids = others[torch.randint(0, len(others), (80,), generator=g)]
    expert_ids[torch.randperm(80, generator=g)[:HOT_EXPERT_ROWS]] = 2
    expert_ids[::7] = -1
    return hidden, expert_ids, w13, w2


def _backend_or_skip(kernels, hidden_size: int, inter: int) -> str:
    backend = kernels.fused_experts_backend(hidden_size, inter)
    if backend == "none":
        pytest.skip("this CPU has no AVX512-BF16: the engine keeps the torch expert paths")
    return backend


# (64, 32): whole AMX tiles; (48, 40): sizes the tiles do not divide, so dot products.
@pytest.mark.parametrize("hidden_size,inter", [(64, 32), (48, 40), (1024, 96)])
def test_fused_experts_match_reference(kernels, hidden_size, inter):
    backend = _backend_or_skip(kernels, hidden_size, inter)
    if hidden_size % 32:
        assert backend == "avx512_bf16"
    hidden, expert_ids, w13, w2 = _case(hidden_size, inter)
    out = fused_experts_forward(hidden, expert_ids, w13, w2)
    ref = reference_experts_forward(hidden, expert_ids, w13, w2)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.equal(out[expert_ids < 0], torch.zeros_like(out[expert_ids < 0]))
    # Only the order of the fp32 sums differs: a rare last-bit flip of gate or up, which the
    # down projection carries into a few outputs as at most one bf16 step of the values here.
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=2**-6)
    assert (out == ref).float().mean().item() > 0.98


def test_fused_experts_empty_and_skipped_rows(kernels):
    _backend_or_skip(kernels, 64, 32)
    hidden, _, w13, w2 = _case(64, 32)
    skipped = fused_experts_forward(hidden[:5], torch.full((5,), -1), w13, w2)
    assert torch.equal(skipped, torch.zeros(5, 64, dtype=torch.bfloat16))
    empty = fused_experts_forward(hidden[:0], torch.zeros(0, dtype=torch.int64), w13, w2)
    assert empty.shape == (0, 64)
    with pytest.raises(ValueError, match="out of range"):
        fused_experts_forward(hidden[:2], torch.tensor([0, NUM_EXPERTS]), w13, w2)


def test_experts_forward_takes_the_kernel_for_bf16_only(kernels):
    backend = _backend_or_skip(kernels, 64, 32)
    hidden, expert_ids, w13, w2 = _case(64, 32)
    # Past a few rows per expert only AMX keeps the kernel; the dot-product path gives way to
    # the grouped matmuls.
    assert fused_experts_backend(hidden.repeat(2, 1), w13) == (
        "amx" if backend == "amx" else None)
    rows = DOT_KERNEL_MAX_ROWS_PER_EXPERT * NUM_EXPERTS
    hidden, expert_ids = hidden[:rows], expert_ids[:rows]
    assert fused_experts_backend(hidden, w13) == backend
    assert torch.equal(experts_forward(hidden, expert_ids, w13, w2),
                       fused_experts_forward(hidden, expert_ids, w13, w2))
    assert fused_experts_backend(hidden.float(), w13.float()) is None
    assert fused_experts_backend(hidden.half(), w13.half()) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_moe_combine_matches_reference(kernels, dtype):
    """The local dispatcher's combine kernel: weighted sum of each token's k rows in fp32."""
    from widellm.layers.moe.dispatch import combine_reference

    g = torch.Generator().manual_seed(3)
    tokens, top_k, hidden = 37, 6, 72
    y = torch.randn(tokens * top_k, hidden, generator=g).to(dtype)
    weights = torch.rand(tokens, top_k, generator=g)
    weights[::5, 2] = 0.0  # skipped slots
    out = kernels.moe_combine(y, weights)
    ref = combine_reference(y, weights, dtype)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    # Same fp32 sum in the same order; at most a fused multiply-add's last bit differs.
    torch.testing.assert_close(out, ref, rtol=1e-6 if dtype == torch.float32 else 2**-8, atol=1e-6)
    assert (out == ref).float().mean().item() > 0.99
    assert kernels.moe_combine(y[:0], weights[:0]).shape == (0, hidden)
