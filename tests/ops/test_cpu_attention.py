"""The in-place paged decode kernel vs its torch reference twin, and the attention layers'
two decode forms (block table vs gathered slots) against each other."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from widellm.forward_context import set_forward_context
from widellm.layers.attention import Attention
from widellm.layers.attention_metadata import build_attention_metadata
from widellm.ops.cpu_attention import paged_decode_attention, paged_decode_attention_reference

BLOCK_SIZE = 4
NUM_BLOCKS = 64

pytestmark = pytest.mark.usefixtures("kernels")  # see conftest.py


def _case(batch, kv_heads, group, dk, dv, dtype, seed=0, shared_v=False):
    """Random cache and queries; block tables whose unused tail points at a NaN-filled block,
    so any read past a sequence's length shows up in the output."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, dk, generator=gen).to(dtype)
    v = k[..., :dv] if shared_v else torch.randn(
        NUM_BLOCKS, BLOCK_SIZE, kv_heads, dv, generator=gen).to(dtype)
    poison = NUM_BLOCKS - 1
    k[poison] = float("nan")
    if not shared_v:
        v[poison] = float("nan")
    seq_lens = torch.tensor([1, 3, 4, 5, 17, 9, 12, 2][:batch], dtype=torch.int64)
    max_blocks = 6
    perm = torch.randperm(NUM_BLOCKS - 1, generator=gen)[: batch * max_blocks]
    block_table = perm.view(batch, max_blocks).clone()
    for b, n in enumerate(seq_lens.tolist()):
        block_table[b, -(-n // BLOCK_SIZE):] = poison
    q = torch.randn(batch, kv_heads, group, dk, generator=gen).to(dtype)
    return q, k, v, block_table, seq_lens


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
# Head sizes off and on the 16-lane path; group sizes off and on its four-row passes.
@pytest.mark.parametrize("kv_heads,group,dk,dv", [
    (1, 1, 8, 8), (2, 3, 16, 16), (3, 1, 20, 20), (2, 5, 64, 64), (1, 6, 80, 64),
])
def test_kernel_matches_reference(dtype, atol, kv_heads, group, dk, dv):
    q, k, v, bt, lens = _case(8, kv_heads, group, dk, dv, dtype)
    out = paged_decode_attention(q, k, v, bt, lens, 0.3)
    ref = paged_decode_attention_reference(q, k, v, bt, lens, 0.3)
    assert out.shape == (8, kv_heads, group, dv) and out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


def test_kernel_mla_shape_values_are_a_view_of_keys():
    """MLA decode: one latent "head" shared by all query heads, V = the first dv columns."""
    q, k, v, bt, lens = _case(5, 1, 6, 24, 16, torch.float32, seed=3, shared_v=True)
    out = paged_decode_attention(q, k, v, bt, lens, 0.2)
    ref = paged_decode_attention_reference(q, k, v, bt, lens, 0.2)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)


def test_single_token_context_returns_its_value():
    q, k, v, bt, lens = _case(1, 2, 3, 8, 8, torch.float32)
    assert lens.tolist() == [1]
    out = paged_decode_attention(q, k, v, bt, lens, 1.0)
    expected = v[bt[0, 0], 0][:, None, :].expand(2, 3, 8)
    torch.testing.assert_close(out[0], expected, atol=0, rtol=0)


def _metadata(context_lens, block_table, in_place):
    n = len(context_lens)
    return build_attention_metadata(
        np.ones(n, dtype=np.int64), np.array(context_lens), np.array(context_lens) - 1,
        block_table, BLOCK_SIZE, decode_in_place=in_place,
    )


def test_metadata_in_place_form():
    bt = np.arange(12, dtype=np.int64).reshape(3, 4)
    md = _metadata([5, 1, 16], bt, True)
    assert md.decode_slots is None and md.decode_mask is None
    assert md.decode_block_table.tolist() == bt.tolist()
    assert md.decode_seq_lens.tolist() == [5, 1, 16]
    assert md.slot_mapping.tolist() == [1 * 4 + 0, 4 * 4 + 0, 11 * 4 + 3]
    ref = _metadata([5, 1, 16], bt, False)
    assert ref.decode_block_table is None and ref.decode_slots.shape == (3, 64)


def test_attention_layer_decode_forms_agree():
    """The same decode step through Attention with either metadata form."""
    heads, kv_heads, dim = 6, 2, 8
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim, generator=gen)
    context_lens = [7, 1, 13, 4]
    bt = torch.randperm(NUM_BLOCKS, generator=gen)[:16].view(4, 4).numpy()
    q = torch.randn(4, heads, dim, generator=gen)
    k = torch.randn(4, kv_heads, dim, generator=gen)
    v = torch.randn(4, kv_heads, dim, generator=gen)
    outs = []
    for in_place in (True, False):
        layer = Attention(heads, dim, kv_heads, scale=dim ** -0.5)
        layer.kv_cache = cache.clone()
        with set_forward_context(_metadata(context_lens, bt, in_place)):
            outs.append(layer(q, k, v))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-6, rtol=0)


def test_mla_layer_decode_forms_agree():
    """MLA decode (absorbed weights) with either metadata form."""
    from widellm.layers.linear import Linear
    from widellm.layers.mla import MLAAttention

    heads, nope, rope, v_dim, lora = 4, 8, 4, 6, 12
    gen = torch.Generator().manual_seed(6)
    kv_b = Linear(lora, heads * (nope + v_dim), bias=False)
    with torch.no_grad():
        kv_b.weight.copy_(torch.randn(kv_b.weight.shape, generator=gen) * 0.3)
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, lora + rope, generator=gen)
    context_lens = [9, 1, 6]
    bt = torch.randperm(NUM_BLOCKS, generator=gen)[:9].view(3, 3).numpy()
    q = torch.randn(3, heads, nope + rope, generator=gen)
    kv_c = torch.randn(3, lora, generator=gen)
    k_pe = torch.randn(3, rope, generator=gen)
    outs = []
    for in_place in (True, False):
        layer = MLAAttention(heads, nope, rope, v_dim, lora, 0.25, kv_b)
        layer.process_weights_after_loading()
        layer.kv_cache = cache.clone()
        with set_forward_context(_metadata(context_lens, bt, in_place)):
            outs.append(layer(q, kv_c, k_pe))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def test_kernel_long_context_peaked_scores():
    """Contexts over many blocks and scores spread over a wide range (a large scale), where the
    kernel's vectorized exp sees arguments far below zero; checked against an fp64 reference
    (fp32 torch itself is 5e-6 off it at scale 3)."""
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, 32, generator=gen)
    v = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, 32, generator=gen)
    block_table = torch.randperm(NUM_BLOCKS, generator=gen)[:2 * 30].view(2, 30)
    seq_lens = torch.tensor([118, 97])
    q = torch.randn(2, 2, 3, 32, generator=gen)
    for scale in (0.05, 3.0):
        out = paged_decode_attention(q, k, v, block_table, seq_lens, scale)
        ref = paged_decode_attention_reference(q.double(), k.double(), v.double(), block_table,
                                               seq_lens, scale)
        torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch,dtype,expected", [
    ("LlamaForCausalLM", "float32", True), ("Qwen3MoeForCausalLM", "float32", True),
    # MLA: the AMX MLA kernel in bf16 where it runs, else the gather + bmm form (MLAAttention).
    ("DeepseekV3ForCausalLM", "float32", False), ("DeepseekV3ForCausalLM", "bfloat16", None),
])
def test_model_runner_picks_decode_form(arch, dtype, expected, model_dir, kernels):
    from widellm import LLM

    from widellm.model.loader import load_hf_config

    path = model_dir(arch)
    if expected is None:  # the tiny model's latent sizes decide (kernel: multiples of 32)
        cfg = load_hf_config(path)
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        expected = kernels.mla_decode_supported(16, width, cfg.kv_lora_rank)
    llm = LLM(path, dtype=dtype, num_kv_blocks=64, max_model_len=256)
    try:
        assert llm.llm_engine.engine_core.model_runner.decode_in_place is expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_kernel_engine_block_size_full_blocks(dtype, atol):
    """Block size 16 (the engine's default): full blocks take the sixteen-row scoring pass,
    the partial last block the four-row and single-row ones."""
    gen = torch.Generator().manual_seed(8)
    k = torch.randn(24, 16, 3, 64, generator=gen).to(dtype)
    v = torch.randn(24, 16, 3, 64, generator=gen).to(dtype)
    block_table = torch.randperm(24, generator=gen)[:20].view(4, 5)
    seq_lens = torch.tensor([80, 35, 16, 1])
    q = torch.randn(4, 3, 3, 64, generator=gen).to(dtype)
    out = paged_decode_attention(q, k, v, block_table, seq_lens, 0.125)
    ref = paged_decode_attention_reference(q.double(), k.double(), v.double(), block_table,
                                           seq_lens, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


def _bf16_case(lens, kv_heads, group, dk, dv, seed, block_size=16, num_blocks=48):
    """bf16 cache in 16-row blocks (the AVX512-BF16 path's shape), with every cache row a
    sequence does not own NaN: the unused tail of its last block and the blocks its table
    lists past its length."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.full((num_blocks, block_size, kv_heads, dk), float("nan"), dtype=torch.bfloat16)
    v = torch.full((num_blocks, block_size, kv_heads, dv), float("nan"), dtype=torch.bfloat16)
    max_blocks = -(-max(lens) // block_size) + 1
    poison = num_blocks - 1
    ids = torch.randperm(num_blocks - 1, generator=gen)
    block_table = torch.full((len(lens), max_blocks), poison, dtype=torch.int64)
    used = 0
    for b, n in enumerate(lens):
        blocks = ids[used:used + -(-n // block_size)]
        used += len(blocks)
        block_table[b, :len(blocks)] = blocks
        for i, blk in enumerate(blocks.tolist()):
            rows = min(block_size, n - i * block_size)
            k[blk, :rows] = torch.randn(rows, kv_heads, dk, generator=gen).to(torch.bfloat16)
            v[blk, :rows] = torch.randn(rows, kv_heads, dv, generator=gen).to(torch.bfloat16)
    q = torch.randn(len(lens), kv_heads, group, dk, generator=gen).to(torch.bfloat16)
    return q, k, v, block_table, torch.tensor(lens, dtype=torch.int64)


# Group sizes 1-4 (one pass of query rows), 5 and 9 (two and three); value widths of 32
# (one 32-column pass), 64 and 96 (a 64- and a 32-column pass); lengths on and off 16 and 2.
@pytest.mark.parametrize("kv_heads,group,dk,dv", [
    (3, 3, 64, 64), (1, 1, 32, 32), (2, 4, 128, 128), (2, 5, 64, 96), (1, 9, 96, 64),
])
def test_bf16_path_matches_fp64_reference(kernels, kv_heads, group, dk, dv):
    lens = [1, 2, 15, 16, 17, 33, 150, 64]
    q, k, v, bt, seq_lens = _bf16_case(lens, kv_heads, group, dk, dv, seed=group + dk)
    assert kernels.paged_decode_attention_backend(16, group, dk, dv) in ("avx512_bf16", "vector")
    out = paged_decode_attention(q, k, v, bt, seq_lens, dk ** -0.5)
    assert out.shape == (len(lens), kv_heads, group, dv) and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    ref = paged_decode_attention_reference(q.double(), k.double(), v.double(), bt, seq_lens,
                                           dk ** -0.5)
    # bf16 probabilities (relative error 2^-9) times values of size ~1, then the bf16 output.
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=1e-2)


def test_bf16_path_single_position_returns_its_value(kernels):
    q, k, v, bt, seq_lens = _bf16_case([1], 2, 3, 64, 64, seed=11)
    out = paged_decode_attention(q, k, v, bt, seq_lens, 0.125)
    expected = v[bt[0, 0], 0][:, None, :].expand(2, 3, 64)
    torch.testing.assert_close(out[0], expected, atol=0, rtol=0)


def test_bf16_path_values_are_a_view_of_keys(kernels):
    """V sharing K's storage (MLA's latent cache through the generic kernel): strided rows."""
    q, k, _, bt, seq_lens = _bf16_case([40, 7], 1, 4, 96, 96, seed=12)
    v = k[..., :64]
    out = paged_decode_attention(q, k, v, bt, seq_lens, 0.1)
    ref = paged_decode_attention_reference(q.double(), k.double(), v.double(), bt, seq_lens, 0.1)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=1e-2)


def test_backend_names_the_path(kernels):
    """bf16 takes the AVX512-BF16 path only for 16-row blocks and 32-multiple head sizes."""
    fast = kernels.paged_decode_attention_backend(16, 3, 64, 64)
    assert fast in ("avx512_bf16", "vector")  # "vector" on CPUs without AVX512-BF16
    assert kernels.paged_decode_attention_backend(4, 3, 64, 64) == "vector"
    assert kernels.paged_decode_attention_backend(16, 3, 48, 64) == "vector"
    assert kernels.paged_decode_attention_backend(16, 3, 64, 80) == "vector"
    assert kernels.paged_decode_attention_backend(32, 3, 64, 64) == fast


def test_bad_block_ids_are_rejected(kernels):
    q, k, v, bt, seq_lens = _bf16_case([20], 1, 2, 32, 32, seed=13)
    bt[0, 1] = k.shape[0]
    with pytest.raises(ValueError, match="block id out of range"):
        paged_decode_attention(q, k, v, bt, seq_lens, 0.2)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, k, v, bt, seq_lens * 100, 0.2)


def test_bf16_path_matches_vector_path(kernels):
    """The two C++ paths on the same bf16 inputs: they differ only where the fast path rounds
    the probabilities to bf16."""
    q, k, v, bt, seq_lens = _bf16_case([150, 3, 64, 31], 3, 3, 64, 64, seed=14)
    fast = kernels.paged_decode_attention(q, k, v, bt, seq_lens, 0.125)
    vector = kernels.paged_decode_attention(q, k, v, bt, seq_lens, 0.125, bf16_dot=False)
    torch.testing.assert_close(fast.float(), vector.float(), atol=1.6e-2, rtol=1e-2)
