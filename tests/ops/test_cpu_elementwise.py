"""Fused SiLU-and-mul, RMSNorm (alone and with the residual add) and rotary kernels against
their torch reference twins, and which path the layers take for each dtype."""

from __future__ import annotations

import pytest
import torch

from widellm.layers.activation import silu_and_mul, silu_and_mul_reference
from widellm.layers.norm import RMSNorm

# One bf16 / fp16 rounding step apart at most (the kernel rounds once where torch rounds twice).
TOLERANCE = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-6}


def _assert_close_relative(out, ref, dtype, steps=1):
    scale = ref.float().abs().clamp(min=1.0)
    err = ((out.float() - ref.float()).abs() / scale).max().item()
    assert err <= steps * TOLERANCE[dtype], err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 8), (5, 37), (64, 96), (300, 1536)])
def test_silu_and_mul_kernel(kernels, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    x = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    x[0, 0], x[0, inter] = 100.0, 3.0  # saturated sigmoid
    if inter > 1:
        x[0, 1] = -100.0
    out = kernels.silu_and_mul(x)
    assert out.shape == (rows, inter) and out.dtype == dtype
    _assert_close_relative(out, silu_and_mul_reference(x.float()).to(dtype), dtype)
    if dtype != torch.float32:
        # Rounded where the reference rounds: only a last-bit difference of exp can show.
        assert (out == silu_and_mul_reference(x)).float().mean().item() > 0.99


def test_silu_and_mul_kernel_strided_rows(kernels):
    base = torch.randn(6, 100).bfloat16()
    x = base[:, 4:84]  # rows 100 apart, last dim contiguous
    _assert_close_relative(kernels.silu_and_mul(x), silu_and_mul_reference(x.float()).bfloat16(),
                           torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 8), (7, 33), (64, 576), (257, 1024)])
def test_rms_norm_kernel(kernels, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    norm = RMSNorm(hidden, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    out = kernels.rms_norm(x, norm.weight.detach(), 1e-5)
    ref = norm.forward_reference(x)
    # Two roundings (the normalised row, then its product with the weight): a sum of squares
    # summed in another order can move the first by one step, which the weight scales
    # (vectorized sums in torch's order on AVX-512; other CPUs differ in a few rows).
    _assert_close_relative(out, ref, dtype, steps=2)
    if dtype != torch.float32:
        # Same rounding steps as the reference: nearly every element is bit-equal (in fp32 the
        # differently ordered sum of squares shows in the last bits).
        assert (out == ref).float().mean().item() > 0.95


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 8), (7, 33), (64, 576)])
def test_fused_add_rms_norm_kernel(kernels, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    norm = RMSNorm(hidden, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    out, h = kernels.fused_add_rms_norm(x, residual, norm.weight.detach(), 1e-5)
    ref_out, ref_h = norm.forward_reference(x, residual)
    # The residual sum is one rounded add, as torch's: bit-equal in every dtype.
    assert torch.equal(h, ref_h)
    # The norm of it is exactly the plain kernel's.
    assert torch.equal(out, kernels.rms_norm(ref_h, norm.weight.detach(), 1e-5))
    _assert_close_relative(out, ref_out, dtype, steps=2)  # as test_rms_norm_kernel
    with pytest.raises(RuntimeError, match="residual must match x"):
        kernels.fused_add_rms_norm(x, residual[:, :-1], norm.weight.detach(), 1e-5)


def test_decoder_residual_stream_matches_unfused_adds(kernels):
    """bf16 decoder layers with the adds fused into the norms give the bits of the plain form
    x + attn(norm(x)), then x + mlp(norm(x))."""
    from types import SimpleNamespace

    from widellm.model.llama import DecoderLayer

    gen = torch.Generator().manual_seed(5)
    cfg = SimpleNamespace(hidden_size=64, rms_norm_eps=1e-6)
    attn = torch.nn.Linear(64, 64, bias=False).bfloat16()
    mlp = torch.nn.Linear(64, 64, bias=False).bfloat16()
    layer = DecoderLayer(cfg, None, mlp).bfloat16()
    layer.self_attn = lambda positions, x: attn(x)  # any map of the normed rows will do
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    with torch.no_grad():
        for norm in (norm1, norm2):
            norm.weight.copy_(torch.randn(64, generator=gen))
    x0 = torch.randn(9, 64, generator=gen).bfloat16()
    with torch.no_grad():
        plain = x0 + attn(norm1(x0))
        plain = plain + mlp(norm2(plain))
        plain = plain + attn(norm1(plain))
        plain = plain + mlp(norm2(plain))
        out, residual = layer(None, x0, None)
        out, residual = layer(None, out, residual)
    assert torch.equal(out + residual, plain)


def test_layers_dispatch_by_dtype(kernels):
    """bf16 and fp32 rows take the kernels (fp32 within its rounding of the reference); fp64
    and non-CPU-kernel dtypes stay on the reference."""
    gen = torch.Generator().manual_seed(9)
    x32 = torch.randn(4, 2, 16, generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        x = x32.to(dtype)
        norm = RMSNorm(16, eps=1e-6, dtype=dtype)
        assert torch.equal(norm(x), kernels.rms_norm(x.view(-1, 16), norm.weight, 1e-6)
                           .view(4, 2, 16))
        _assert_close_relative(norm(x), norm.forward_reference(x), dtype, steps=2)
        # 3-D contiguous input (the masked experts' layout) goes through the kernel too.
        assert torch.equal(silu_and_mul(x), kernels.silu_and_mul(x.view(-1, 16)).view(4, 2, 8))
        _assert_close_relative(silu_and_mul(x), silu_and_mul_reference(x), dtype)
    x64 = x32.double()
    norm64 = RMSNorm(16, eps=1e-6, dtype=torch.float64)
    assert torch.equal(norm64(x64), norm64.forward_reference(x64))
    assert torch.equal(silu_and_mul(x64), silu_and_mul_reference(x64))


@pytest.mark.parametrize("rotary_dim", [16, 64, 72])  # halves: below one 16-lane vector,
# whole vectors (the one-pass bf16 path), past one vector
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_kernel(kernels, style, dtype, rotary_dim):
    from types import SimpleNamespace

    from widellm.layers.rotary import RotaryEmbedding

    cfg = SimpleNamespace(rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64)
    rope = RotaryEmbedding(cfg, rotary_dim, 64, style=style)
    gen = torch.Generator().manual_seed(11)
    positions = torch.tensor([0, 5, 63, 17, 2])
    q_full = torch.randn(5, 3, rotary_dim + 8, generator=gen).to(dtype)
    q = q_full[..., 8:]  # a slice of wider heads, as DeepSeek's q_pe
    k = torch.randn(5, 1, rotary_dim, generator=gen).to(dtype)
    ref_q, ref_k = rope.forward_reference(positions, q.float(), k.float())
    for x, ref in ((q, ref_q), (k, ref_k)):
        out = kernels.rotary_embedding(positions, x, rope.cos_cache, rope.sin_cache,
                                       style == "interleaved")
        assert out.shape == x.shape and out.is_contiguous()
        _assert_close_relative(out, ref.to(dtype), dtype)
    if dtype == torch.bfloat16:
        # Same roundings as the reference, and no exp or sum to differ in: bit-equal.
        ref16_q, ref16_k = rope.forward_reference(positions, q, k)
        fused_q, fused_k = rope(positions, q, k)
        assert torch.equal(fused_q, ref16_q) and torch.equal(fused_k, ref16_k)
        assert torch.equal(fused_q, kernels.rotary_embedding(
            positions, q, rope.cos_cache, rope.sin_cache, style == "interleaved"))
