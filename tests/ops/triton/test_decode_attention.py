"""Paged GQA decode attention and MLA decode attention (Triton) against their torch twins.

Every case poisons the cache: all rows no sequence owns, the unused tail of each sequence's
last block, and the row just before the cache's first block (what a block id of -1 would
address) hold NaN, and block-table entries past a sequence's blocks are -1. So any read past
a sequence's length, of an unused block-table entry, or by a seq_len 0 padding row shows up as
NaN in the output.

Tolerances (values ~N(0, 1), so the largest |v| is ~4):
* fp32: kernel and twin differ only in summation order and exp2 vs exp, ~1e-6 relative; 1e-5
  leaves margin.
* bf16: products of bf16 values are exact in fp32, so scores agree to fp32 rounding; the kernel
  rounds the probabilities to bf16 (relative error <= 2^-8 each) before the value product,
  which moves the output by <= 2^-8 * max|v| (the probabilities sum to 1), and both outputs are
  rounded to bf16 (<= 2^-8 relative each, so 2^-7 apart). Tolerance: atol 2^-7 * max|v|
  (twice that bound), rtol 2^-6 (twice the rounding bound).
"""

from __future__ import annotations

import pytest
import torch

from widellm.ops.triton_mla_decode import mla_decode_attention, mla_decode_attention_reference
from widellm.ops.triton_paged_decode import (
    paged_decode_attention, paged_decode_attention_reference,
)

# Partial first / middle / last blocks for block sizes 16 and 64, one whole 64-token block,
# a single token, and a seq_len 0 padding row (as a CUDA-graph bucket pads a batch).
SEQ_LENS = (37, 0, 130, 1, 64)
PAD_ROW = SEQ_LENS.index(0)
# Cache blocks no sequence owns (poisoned), shuffled among the used ones.
SPARE_BLOCKS = 5
NUM_KV_HEADS = 2
# DeepSeek-V3's MLA: kv_lora_rank 512, qk_rope_head_dim 64, softmax scale 1/sqrt(128 + 64).
DSV3_KV_LORA_RANK = 512
DSV3_ROPE_DIM = 64
DSV3_SCALE = (128 + 64) ** -0.5
# Scaled down 4x for the cheaper cases, and 16 query heads instead of 128.
SMALL_KV_LORA_RANK = 128
SMALL_ROPE_DIM = 32
MLA_HEADS = 16
FP32_TOL = 1e-5
BF16_ROUNDING = 2.0 ** -7
BF16_RTOL = 2.0 ** -6


def _paged_layout(seq_lens, block_size, index_dtype, gen):
    """Shuffled, non-contiguous block tables [B, max_blocks] (-1 past each sequence's
    blocks), the pool size, and the flat slot of every live position."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + SPARE_BLOCKS
    ids = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((len(seq_lens), max(needed) + 1), -1, dtype=torch.int64)
    slots, taken = [], 0
    for b, (n, k) in enumerate(zip(seq_lens, needed)):
        block_table[b, :k] = ids[taken:taken + k]
        taken += k
        pos = torch.arange(n)
        slots.append(block_table[b, pos // block_size] * block_size + pos % block_size)
    return block_table.to(index_dtype), num_blocks, torch.cat(slots)


def _poisoned_cache(lead, num_blocks, block_size, row, slots, dtype, gen, device):
    """[*lead, num_blocks, block_size, *row] on ``device``: random rows at ``slots``, NaN
    elsewhere and in the block before block 0 (the cache is a view one block into its
    storage)."""
    storage = torch.full((*lead, num_blocks + 1, block_size, *row), float("nan"), dtype=dtype)
    flat = storage.narrow(len(lead), 1, num_blocks).flatten(len(lead), len(lead) + 1)
    index = (slice(None),) * len(lead) + (slots,)
    flat[index] = torch.randn(*lead, len(slots), *row, generator=gen).to(dtype)
    return storage.to(device).narrow(len(lead), 1, num_blocks)


def _assert_matches_twin(out, ref, v_max, dtype):
    """Kernel output vs twin with the module docstring's tolerances; the padding row exactly
    zero."""
    assert not out.isnan().any()
    assert torch.equal(out[PAD_ROW], torch.zeros_like(out[PAD_ROW]))
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=FP32_TOL, rtol=FP32_TOL)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=BF16_ROUNDING * v_max,
                                   rtol=BF16_RTOL)


def _paged_case(group, head_dim, block_size, dtype, index_dtype, device, seed=0,
                num_kv_heads=NUM_KV_HEADS):
    gen = torch.Generator().manual_seed(seed)
    block_table, num_blocks, slots = _paged_layout(SEQ_LENS, block_size, index_dtype, gen)
    # K and V as the two halves of one [2, num_blocks, block_size, Hkv, D] cache, as
    # widellm's attention layers store them.
    kv = _poisoned_cache((2,), num_blocks, block_size, (num_kv_heads, head_dim), slots, dtype,
                         gen, device)
    q = torch.randn(len(SEQ_LENS), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(SEQ_LENS, dtype=index_dtype)
    return (q.to(device), kv[0], kv[1], block_table.to(device), seq_lens.to(device),
            head_dim ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("group,head_dim", [(1, 128), (4, 64), (8, 128)])
def test_paged_decode_matches_twin(group, head_dim, block_size, dtype, device):
    index_dtype = torch.int64 if block_size == 16 else torch.int32
    args = _paged_case(group, head_dim, block_size, dtype, index_dtype, device)
    ref = paged_decode_attention_reference(*args)
    out = paged_decode_attention(*args)
    assert out.shape == ref.shape and out.dtype == dtype
    _assert_matches_twin(out, ref, args[2].nan_to_num().abs().max().item(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [3, 8])
def test_paged_decode_split_k_matches_twin(num_splits, dtype, device):
    """Flash-decoding splits, including more splits than a short context has tiles (empty
    splits), into a preallocated output."""
    args = _paged_case(4, 64, 16, dtype, torch.int32, device, seed=1)
    out = torch.full_like(args[0], float("nan"))
    paged_decode_attention(*args, num_splits=num_splits, out=out)
    ref = paged_decode_attention_reference(*args)
    _assert_matches_twin(out, ref, args[2].nan_to_num().abs().max().item(), dtype)


def test_paged_decode_group_wider_than_one_program(device):
    """A group of 96 query heads on one KV head spans two head blocks (64 + 32 masked)."""
    args = _paged_case(96, 64, 16, torch.float32, torch.int64, device, num_kv_heads=1)
    _assert_matches_twin(paged_decode_attention(*args), paged_decode_attention_reference(*args),
                         1.0, torch.float32)


def test_paged_decode_all_padding_and_empty_batch(device):
    """A batch of only seq_len 0 rows (block tables all -1) gives zeros; B = 0 gives []."""
    q, k, v, _, _, scale = _paged_case(4, 64, 16, torch.float32, torch.int64, device)
    block_table = torch.full((3, 4), -1, dtype=torch.int64, device=device)
    seq_lens = torch.zeros(3, dtype=torch.int64, device=device)
    for num_splits in (1, 4):
        out = paged_decode_attention(q[:3], k, v, block_table, seq_lens, scale, num_splits)
        assert torch.equal(out, torch.zeros_like(out))
    empty = paged_decode_attention(q[:0], k, v, block_table[:0], seq_lens[:0], scale)
    assert empty.shape == (0, q.shape[1], q.shape[2])


def _mla_case(num_heads, kv_lora_rank, rope_dim, block_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    block_table, num_blocks, slots = _paged_layout(SEQ_LENS, block_size, torch.int64, gen)
    width = kv_lora_rank + rope_dim
    kv_cache = _poisoned_cache((), num_blocks, block_size, (width,), slots, dtype, gen, device)
    q_cat = torch.randn(len(SEQ_LENS), num_heads, width, generator=gen).to(dtype)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int64)
    return (q_cat.to(device), kv_cache, block_table.to(device), seq_lens.to(device),
            kv_lora_rank, DSV3_SCALE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("kv_lora_rank,rope_dim", [
    (DSV3_KV_LORA_RANK, DSV3_ROPE_DIM), (SMALL_KV_LORA_RANK, SMALL_ROPE_DIM),
])
def test_mla_decode_matches_twin(kv_lora_rank, rope_dim, block_size, dtype, device):
    args = _mla_case(MLA_HEADS, kv_lora_rank, rope_dim, block_size, dtype, device)
    ref = mla_decode_attention_reference(*args)
    out = mla_decode_attention(*args)
    assert out.shape == (len(SEQ_LENS), MLA_HEADS, kv_lora_rank) and out.dtype == dtype
    v_max = args[1][..., :kv_lora_rank].nan_to_num().abs().max().item()
    _assert_matches_twin(out, ref, v_max, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_split_k_matches_twin(dtype, device):
    """DeepSeek-V3's latent widths with 4 splits (empty ones for the short rows)."""
    args = _mla_case(MLA_HEADS, DSV3_KV_LORA_RANK, DSV3_ROPE_DIM, 16, dtype, device, seed=2)
    out = torch.full((len(SEQ_LENS), MLA_HEADS, DSV3_KV_LORA_RANK), float("nan"), dtype=dtype,
                     device=device)
    mla_decode_attention(*args, num_splits=4, out=out)
    v_max = args[1][..., :DSV3_KV_LORA_RANK].nan_to_num().abs().max().item()
    _assert_matches_twin(out, mla_decode_attention_reference(*args), v_max, dtype)


@pytest.mark.parametrize("num_heads", [20, 128])
def test_mla_decode_head_blocks(num_heads, device):
    """Head counts that are not one full head block: 20 (masked to 32) and DeepSeek-V3's 128
    (two blocks of 64), on the scaled-down latent."""
    args = _mla_case(num_heads, SMALL_KV_LORA_RANK, SMALL_ROPE_DIM, 16, torch.float32, device,
                     seed=3)
    _assert_matches_twin(mla_decode_attention(*args), mla_decode_attention_reference(*args),
                         1.0, torch.float32)
