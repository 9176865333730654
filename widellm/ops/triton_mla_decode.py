"""MLA decode attention (DeepSeek-V2/V3) over the paged latent cache in Triton, with weight
absorption, and its torch reference twin.

The cache holds per token one row ``[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]``
(DeepSeek-V3: 512 + 64). With ``q_nope`` already folded through ``W_UK`` (see
:meth:`widellm.layers.mla.MLAAttention._absorb_query`) every query head scores against that
whole row, one key "head" shared by all H query heads, and the values are the row's first
``kv_lora_rank`` columns:

    q_cat [B, H, kv_lora_rank + rope], kv_cache [num_blocks, block_size, kv_lora_rank + rope],
    block_table [B, max_blocks] int, seq_lens [B] int  ->  out [B, H, kv_lora_rank]

    out[b, h] = softmax_l(scale * q_cat[b, h] . C[l]) C[l, :kv_lora_rank],  l < seq_lens[b]

One program handles one sequence, a block of up to ``MAX_BLOCK_H`` heads and one split of the
context; each latent tile is loaded once and used twice (keys, then values), and the latent
and rope parts of the score are two matmuls so neither width needs padding to a power of two
(576 is not one). Splits (flash-decoding) merge through
:func:`widellm.ops.triton_paged_decode.combine_splits`. Rows with ``seq_len == 0`` (CUDA-graph
padding) give zeros and read nothing from the cache or their block-table row.

How an attention backend calls this: the MLA layer's decode forward absorbs the query
(``_absorb_query``), calls :func:`mla_decode_attention` with the layer's ``kv_cache``, the
metadata's ``decode_block_table`` / ``decode_seq_lens`` (fixed, seq_len-0-padded buffers under
CUDA graphs, plus a preallocated ``out``) and the layer's ``kv_lora_rank`` and ``scale``,
then maps the result back per head through ``W_UV`` (``w_uv_t``), exactly where the CPU path
calls its MLA kernel in ``MLAAttention._decode_in_place``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from widellm.ops.triton_paged_decode import (
    LOG2E, MIN_DOT_DIM, NUM_WARPS, check_decode_inputs, combine_splits, dot_precision,
    dot_upcast, head_block, mma, paged_decode_attention_reference, split_buffers, split_range,
    store_decode_result,
)

# Context tokens per loop iteration: a 32 x 512 latent tile in bf16 is 32 KiB, loaded once for
# the scores and the value product.
MLA_BLOCK_N = 32
# Wider programs (16+ heads x 512 latent columns of fp32 accumulator) spread over more warps.
MLA_NUM_WARPS = 2 * NUM_WARPS


@triton.jit
def _mla_decode_kernel(
    q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    scale_log2, page_size,
    stride_qb, stride_qh,
    stride_cb, stride_ct,
    stride_btb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    NUM_HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_LORA: tl.constexpr, BLOCK_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (B, cdiv(H, BLOCK_H), NUM_SPLITS). Online softmax in base 2 (scale_log2 = scale *
    log2 e) over the split's positions, tiles of BLOCK_N tokens."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < NUM_HEADS
    offs_l = tl.arange(0, BLOCK_LORA)
    l_mask = offs_l < LORA
    offs_r = tl.arange(0, BLOCK_ROPE)
    r_mask = offs_r < ROPE

    seq_len = tl.load(seq_lens_ptr + pid_b).to(tl.int32)
    lo, hi = split_range(seq_len, pid_s, NUM_SPLITS, BLOCK_N)

    q_rows = q_ptr + pid_b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_l[None, :], mask=head_mask[:, None] & l_mask[None, :],
                    other=0.0)
    q_pe = tl.load(q_rows + LORA + offs_r[None, :], mask=head_mask[:, None] & r_mask[None, :],
                   other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_LORA], dtype=tl.float32)
    bt_row = bt_ptr + pid_b.to(tl.int64) * stride_btb
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        # int64: block id x block stride overflows int32 in caches past ~2^31 elements.
        blocks = tl.load(bt_row + offs_n // page_size, mask=n_mask, other=0).to(tl.int64)
        rows = kv_ptr + blocks * stride_cb + (offs_n % page_size).to(tl.int64) * stride_ct
        # Masked-off positions load as 0, so a NaN in a block's unused tail cannot reach the
        # value product through a zero probability (0 * NaN = NaN).
        c_kv = tl.load(rows[:, None] + offs_l[None, :], mask=n_mask[:, None] & l_mask[None, :],
                       other=0.0)
        k_pe = tl.load(rows[:, None] + LORA + offs_r[None, :],
                       mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        s = mma(q_lat, tl.trans(c_kv), tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32),
                DOT_UPCAST, DOT_PRECISION)
        s = mma(q_pe, tl.trans(k_pe), s, DOT_UPCAST, DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(p.to(c_kv.dtype), c_kv, acc * alpha[:, None], DOT_UPCAST, DOT_PRECISION)
        m_i = m_new

    store_decode_result(acc, m_i, l_i, out_ptr, lse_ptr, heads, head_mask, offs_l, l_mask,
                        pid_b, pid_s, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                        NUM_SPLITS)


def mla_decode_attention(
    q_cat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, kv_lora_rank: int, scale: float,
    num_splits: int = 1, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_cat [B, H, kv_lora_rank + rope] (absorbed latent query | rotated rope query);
    kv_cache [num_blocks, block_size, kv_lora_rank + rope] (last dim contiguous);
    block_table [B, max_blocks] int32/int64; seq_lens [B] int32/int64 ->
    out [B, H, kv_lora_rank] in q_cat's dtype (written into ``out`` when given). Accumulates
    in fp32; ``num_splits`` > 1 splits each context (flash-decoding)."""
    B, H, Dk = q_cat.shape
    page_size = kv_cache.shape[1]
    rope = Dk - kv_lora_rank
    if kv_cache.dim() != 3 or kv_cache.shape[2] != Dk or rope < 0:
        raise ValueError(f"q_cat {tuple(q_cat.shape)} / kv_cache {tuple(kv_cache.shape)} do "
                         f"not fit kv_lora_rank {kv_lora_rank}")
    if q_cat.stride(2) != 1 or kv_cache.stride(2) != 1:
        raise ValueError("the last dimension of q_cat and kv_cache must be contiguous")
    check_decode_inputs(block_table, seq_lens, B, num_splits)
    if out is None:
        out = q_cat.new_empty(B, H, kv_lora_rank)
    if B == 0:
        return out
    block_h = head_block(H)
    dest, lse = split_buffers(out, num_splits)
    _mla_decode_kernel[(B, triton.cdiv(H, block_h), num_splits)](
        q_cat, kv_cache, block_table, seq_lens, dest, lse,
        scale * LOG2E, page_size,
        q_cat.stride(0), q_cat.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        dest.stride(0), dest.stride(1), dest.stride(2),
        lse.stride(0) if num_splits > 1 else 0, lse.stride(1) if num_splits > 1 else 0,
        NUM_HEADS=H, LORA=kv_lora_rank, ROPE=rope,
        BLOCK_LORA=triton.next_power_of_2(kv_lora_rank),
        # Still a matmul dimension when a model has no rope part (then fully masked).
        BLOCK_ROPE=max(triton.next_power_of_2(rope), MIN_DOT_DIM),
        BLOCK_H=block_h, BLOCK_N=MLA_BLOCK_N, NUM_SPLITS=num_splits,
        DOT_UPCAST=dot_upcast(kv_cache), DOT_PRECISION=dot_precision(kv_cache),
        num_warps=MLA_NUM_WARPS,
    )
    combine_splits(dest, lse, out)
    return out


def mla_decode_attention_reference(
    q_cat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, kv_lora_rank: int, scale: float,
) -> torch.Tensor:
    """Twin of :func:`mla_decode_attention` (same shapes): the latent cache as one KV head
    whose values are its first kv_lora_rank columns, through the paged reference (gather,
    fp32 softmax attention, seq_len 0 rows zero), as ``MLAAttention._decode_in_place`` does
    on CPUs without the AMX kernel."""
    cache = kv_cache.unsqueeze(2)  # [num_blocks, block_size, 1, kv_lora_rank + rope]
    return paged_decode_attention_reference(q_cat, cache, cache[..., :kv_lora_rank],
                                            block_table, seq_lens, scale)
