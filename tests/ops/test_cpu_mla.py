"""The AMX MLA decode kernel (``ops/cpu/mla_decode.cpp``) against the gather + bmm decode form
it replaces (its reference twin, ``MLAAttention._decode_absorbed``) and the fp32 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.cpu_info import cpu_flags
from widellm.forward_context import set_forward_context
from widellm.layers.attention_metadata import build_attention_metadata
from widellm.layers.linear import Linear
from widellm.layers.mla import MLAAttention
from widellm.ops.cpu_attention import paged_decode_attention_reference

pytestmark = pytest.mark.usefixtures("kernels")

BLOCK = 16  # the kernel's block size: one cache block is one 16-row score tile
NUM_BLOCKS = 40
# 20 heads: a full 16-head chunk and a partial one. Latent 64 + rope 32 = 96 = 3 tile k-steps.
HEADS, NOPE, ROPE, V_DIM, LORA = 20, 32, 32, 48, 64
# One token, exactly one block, one past it, two blocks and one, several blocks.
CONTEXT_LENS = [1, 16, 17, 33, 70]


def _skip_without_kernel(kernels):
    if not kernels.mla_decode_supported(BLOCK, LORA + ROPE, LORA):
        pytest.skip("this CPU has no AMX: MLA keeps the gather + bmm decode form")


def _layer_and_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    kv_b = Linear(LORA, HEADS * (NOPE + V_DIM), bias=False)
    with torch.no_grad():
        kv_b.weight.copy_(torch.randn(kv_b.weight.shape, generator=gen) * 0.2)
    kv_b = kv_b.to(torch.bfloat16)
    layer = MLAAttention(HEADS, NOPE, ROPE, V_DIM, LORA, 0.15, kv_b)
    layer.process_weights_after_loading()
    cache = torch.randn(NUM_BLOCKS, BLOCK, LORA + ROPE, generator=gen).bfloat16()
    # Table entries past each sequence's blocks point at a NaN block: any read past the end
    # would show up in the output.
    poison = NUM_BLOCKS - 1
    cache[poison] = float("nan")
    max_blocks = 6
    bt = torch.randperm(NUM_BLOCKS - 1, generator=gen)[: len(CONTEXT_LENS) * max_blocks]
    bt = bt.view(len(CONTEXT_LENS), max_blocks).clone()
    for b, n in enumerate(CONTEXT_LENS):
        bt[b, -(-n // BLOCK):] = poison
    n = len(CONTEXT_LENS)
    q = torch.randn(n, HEADS, NOPE + ROPE, generator=gen).bfloat16()
    kv_c = torch.randn(n, LORA, generator=gen).bfloat16()
    k_pe = torch.randn(n, ROPE, generator=gen).bfloat16()
    return layer, cache, bt.numpy(), q, kv_c, k_pe


def _decode(layer, cache, bt, q, kv_c, k_pe, in_place: bool) -> torch.Tensor:
    n = len(CONTEXT_LENS)
    md = build_attention_metadata(
        np.ones(n, dtype=np.int64), np.array(CONTEXT_LENS), np.array(CONTEXT_LENS) - 1,
        bt, BLOCK, decode_in_place=in_place,
    )
    layer.kv_cache = cache.clone()
    with set_forward_context(md):
        return layer(q, kv_c, k_pe)


def test_mla_layer_prefers_the_kernel_in_bf16_only(kernels):
    _skip_without_kernel(kernels)
    layer, *_ = _layer_and_inputs()
    assert layer.prefers_in_place_decode(BLOCK)
    assert not layer.prefers_in_place_decode(2 * BLOCK)  # the kernel's tiles are 16 tokens
    kv_b = Linear(LORA, HEADS * (NOPE + V_DIM))
    fp32 = MLAAttention(HEADS, NOPE, ROPE, V_DIM, LORA, 0.15, kv_b)
    fp32.process_weights_after_loading()
    assert not fp32.prefers_in_place_decode(BLOCK)


def test_mla_kernel_matches_the_gather_form(kernels):
    _skip_without_kernel(kernels)
    layer, cache, bt, q, kv_c, k_pe = _layer_and_inputs()
    kernel = _decode(layer, cache, bt, q, kv_c, k_pe, in_place=True)
    gather = _decode(layer, cache, bt, q, kv_c, k_pe, in_place=False)
    assert kernel.shape == (len(CONTEXT_LENS), HEADS, V_DIM) and not kernel.isnan().any()
    # Same roundings (scores, probabilities, latent output in bf16); only fp32 sum order
    # differs, so a rare bf16 step in the latent output, carried through W_UV.
    torch.testing.assert_close(kernel, gather, rtol=2**-6, atol=2**-5)
    assert (kernel == gather).float().mean().item() > 0.9


def test_mla_kernel_close_to_fp32_attention(kernels):
    """The latent attention itself against the fp32 gather reference (no bf16 roundings)."""
    _skip_without_kernel(kernels)
    layer, cache, bt, q, kv_c, k_pe = _layer_and_inputs(seed=1)
    q_cat = layer._absorb_query(q).contiguous()
    lens = torch.tensor(CONTEXT_LENS)
    out = kernels.mla_decode_attention(q_cat, cache, torch.from_numpy(bt), lens, LORA, 0.15)
    ref = paged_decode_attention_reference(q_cat.unsqueeze(1), cache.unsqueeze(2),
                                           cache[..., :LORA].unsqueeze(2), torch.from_numpy(bt),
                                           lens, 0.15).squeeze(1)
    assert out.shape == (len(CONTEXT_LENS), HEADS, LORA)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=0.05)
    # A one-token context returns its value row exactly (probability 1).
    assert torch.equal(out[0], cache[bt[0, 0], 0, :LORA].expand(HEADS, LORA))


def test_mla_kernel_rejects_bad_tables(kernels):
    _skip_without_kernel(kernels)
    layer, cache, bt, q, *_ = _layer_and_inputs()
    q_cat = layer._absorb_query(q).contiguous()
    bad = torch.from_numpy(bt).clone()
    bad[0, 0] = NUM_BLOCKS
    with pytest.raises(ValueError, match="block id out of range"):
        kernels.mla_decode_attention(q_cat, cache, bad, torch.tensor(CONTEXT_LENS), LORA, 0.15)
    with pytest.raises(ValueError, match="seq_lens"):
        kernels.mla_decode_attention(q_cat, cache, torch.from_numpy(bt),
                                     torch.tensor([0, 1, 1, 1, 1]), LORA, 0.15)


def test_amx_paths_stay_off_without_amx(kernels):
    """Where the AMX tests above skip, the AMX paths must not run either: the CPU's own flags
    (an oracle independent of the kernels' checks) decide whether the MLA kernel is offered,
    and without AMX the layer keeps the gather form (the tested twin) even in bf16."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this platform")
    if "amx_tile" in flags and "amx_bf16" in flags:
        pytest.skip("AMX here: the kernel tests above cover the path")
    assert not kernels.mla_decode_supported(BLOCK, LORA + ROPE, LORA)
    layer, *_ = _layer_and_inputs()
    assert not layer.prefers_in_place_decode(BLOCK)
    if "avx512_bf16" not in flags:
        # No bf16 experts kernel either: the routed experts keep torch's (tested) paths here
        # (experts.fused_experts_backend).
        assert kernels.fused_experts_backend(256, 512) == "none"
