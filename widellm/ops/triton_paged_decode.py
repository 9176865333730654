"""Paged decode attention with grouped-query heads in Triton, and its torch reference twin.

One query token per sequence attends over that sequence's context, read in place from the
paged KV cache through its block table (no gather, no per-head expansion of K/V):

    q [B, Hq, D], k_cache [num_blocks, block_size, Hkv, D], v_cache [..., Hkv, Dv],
    block_table [B, max_blocks] int, seq_lens [B] int  ->  out [B, Hq, Dv] in q's dtype

Query head h reads KV head ``h // (Hq // Hkv)`` (heads of one group are adjacent, as in
:mod:`widellm.layers.attention`). One program handles one sequence, up to ``BLOCK_H`` query
heads of one KV group (so each K/V tile is loaded once for the whole group and the scores are
a tensor-core matmul), and one split of the context. With ``num_splits > 1`` (flash-decoding,
for few sequences with long contexts) every split writes a normalised partial output and its
log-sum-exp, and :func:`combine_splits` merges them; ``num_splits`` only sets the grid, so a
CUDA graph captures it as a fixed launch parameter of its batch-size bucket.

Rows with ``seq_len == 0`` (the padding rows of a CUDA-graph bucket, whose block-table rows may
hold -1) produce zeros and read neither the cache nor their block-table row. Positions past a
sequence's end are never loaded, so whatever the tail of its last block holds cannot leak in.

How an attention backend calls this: its decode forward, after the new K/V rows are stored,
passes the layer's query rows of the decode sequences, ``kv_cache[0]`` / ``kv_cache[1]`` of
the layer, and the metadata's ``decode_block_table`` / ``decode_seq_lens`` (device tensors,
int32 or int64; for CUDA-graph replay, fixed buffers padded with seq_len 0 rows), optionally
with a preallocated ``out`` so graph capture and replay reuse one buffer.
:func:`paged_decode_attention_reference` is the twin (gather, then fp32 softmax attention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from widellm.ops.cpu_attention import paged_decode_attention_reference as _grouped_reference

# tl.dot needs every matmul dimension to be at least 16 on NVIDIA tensor cores; head blocks
# and token tiles are padded up to it.
MIN_DOT_DIM = 16
# Most query heads one program serves: a GQA group (or MLA's heads) larger than this is split
# over several programs so the fp32 accumulator [BLOCK_H, D] stays in registers.
MAX_BLOCK_H = 64
# Context tokens per loop iteration (they may span several cache blocks): 64 x 128 K and V
# tiles in bf16 are 16 KiB each.
PAGED_BLOCK_N = 64
# log2(e): scores are scaled into base 2 once so the loop uses exp2, the GPU's native exp.
LOG2E = 1.4426950408889634
NUM_WARPS = 4


def head_block(group: int) -> int:
    """Query heads per program for ``group`` heads sharing one KV head: a power of two in
    [MIN_DOT_DIM, MAX_BLOCK_H]."""
    return min(max(MIN_DOT_DIM, triton.next_power_of_2(group)), MAX_BLOCK_H)


def dot_upcast(cache: torch.Tensor) -> bool:
    """Whether the kernels' matmuls must take fp32 copies of bf16 operands: only in Triton's
    interpreter (CPU tensors), which stores bf16 as uint16 and multiplies the bit patterns in
    ``tl.dot`` (triton-lang/triton#11584, unsupported as of 3.9). Exact for the loaded bf16
    K/V tiles and queries, and the probabilities are rounded to bf16 first either way, so the
    interpreter computes what a GPU's bf16 tensor cores compute (up to summation order)."""
    return cache.dtype == torch.bfloat16 and cache.device.type == "cpu"


def dot_precision(cache: torch.Tensor) -> str:
    """Matmul precision: full fp32 products ("ieee") for fp32 operands (tf32 would cost ~1e-3
    relative error); for bf16 operands on tensor cores the choice is moot."""
    return "ieee" if cache.dtype == torch.float32 or dot_upcast(cache) else "tf32"


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b in fp32; bf16 operands widened first under UPCAST (see
    :func:`dot_upcast`)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc=acc, input_precision=DOT_PRECISION)


@triton.jit
def store_decode_result(
    acc, m_i, l_i, out_ptr, lse_ptr, heads, head_mask, offs_d, d_mask,
    pid_b, pid_s, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    NUM_SPLITS: tl.constexpr,
):
    """Write one program's result: acc [BLOCK_H, BLOCK_D] fp32 (unnormalised), m_i / l_i
    [BLOCK_H] (running max in base 2, running sum). A split that saw no position writes a zero
    output and lse -inf (its weight in :func:`combine_splits`)."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_ptrs = out_ptr + pid_b * stride_ob + heads[:, None] * stride_oh + pid_s * stride_os
    o_ptrs = o_ptrs + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & d_mask[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + pid_b * stride_lb + heads * stride_lh + pid_s, lse, mask=head_mask)


@triton.jit
def split_range(seq_len, pid_s, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions [lo, hi) of split ``pid_s``: equal shares rounded up to whole tiles, so only
    the last tile of the last non-empty split is partial. Empty (lo >= hi) when seq_len is 0."""
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = pid_s * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    return lo, hi


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    scale_log2, page_size,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_btb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (B, Hkv * HEAD_BLOCKS, NUM_SPLITS). Online softmax over the split's positions in
    tiles of BLOCK_N; scores in base 2 (scale_log2 = scale * log2 e)."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    kv_head = pid_h // HEAD_BLOCKS
    offs_g = (pid_h % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < V_DIM

    seq_len = tl.load(seq_lens_ptr + pid_b).to(tl.int32)
    lo, hi = split_range(seq_len, pid_s, NUM_SPLITS, BLOCK_N)

    q_ptrs = q_ptr + pid_b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    bt_row = bt_ptr + pid_b.to(tl.int64) * stride_btb
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        # int64: block id x block stride overflows int32 in caches past ~2^31 elements.
        blocks = tl.load(bt_row + offs_n // page_size, mask=n_mask, other=0).to(tl.int64)
        in_block = (offs_n % page_size).to(tl.int64)
        k_rows = k_ptr + blocks * stride_kb + in_block * stride_kt + kv_head * stride_kh
        k = tl.load(k_rows[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                    other=0.0)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), DOT_UPCAST,
                DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # Masked-off positions load as 0: a NaN left in a block's unused tail would otherwise
        # survive the zero probability (0 * NaN = NaN).
        v_rows = v_ptr + blocks * stride_vb + in_block * stride_vt + kv_head * stride_vh
        v = tl.load(v_rows[:, None] + offs_dv[None, :],
                    mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_UPCAST, DOT_PRECISION)
        m_i = m_new

    store_decode_result(acc, m_i, l_i, out_ptr, lse_ptr, heads, head_mask, offs_dv, dv_mask,
                        pid_b, pid_s, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                        NUM_SPLITS)


@triton.jit
def _combine_splits_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Grid (B, H): out = sum_s w_s * part_s / sum_s w_s with w_s = 2^(lse_s - max lse);
    zeros when every split was empty (seq_len 0)."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < V_DIM
    lse = tl.load(lse_ptr + pid_b * stride_lb + pid_h * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, axis=0)
    # All splits empty: max is -inf and -inf - -inf would be NaN; any finite shift gives w = 0.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    p_ptrs = part_ptr + pid_b * stride_pb + pid_h * stride_ph
    part = tl.load(p_ptrs + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(w[:, None] * part, axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + pid_b * stride_ob + pid_h * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=d_mask)


def split_buffers(
    out: torch.Tensor, num_splits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the attention kernel writes for ``out`` [B, H, Dv]: with one split, ``out`` itself
    viewed as [B, H, 1, Dv] (plus an unused lse placeholder); else fp32 partial outputs
    [B, H, S, Dv] and their log-sum-exps (base 2) [B, H, S]."""
    B, H, Dv = out.shape
    if num_splits == 1:
        return out.unsqueeze(2), out.new_empty(0, dtype=torch.float32)
    part = torch.empty(B, H, num_splits, Dv, dtype=torch.float32, device=out.device)
    lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=out.device)
    return part, lse


def combine_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """out [B, H, Dv] <- the splits' partial outputs part [B, H, S, Dv] fp32 weighted by
    their log-sum-exps lse [B, H, S] fp32 (base 2). No-op with one split (the kernel wrote
    ``out`` directly)."""
    B, H, num_splits, Dv = part.shape
    if num_splits == 1 or B == 0:
        return
    _combine_splits_kernel[(B, H)](
        part, lse, out,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        V_DIM=Dv, BLOCK_DV=triton.next_power_of_2(Dv), NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), num_warps=NUM_WARPS,
    )


def check_decode_inputs(block_table: torch.Tensor, seq_lens: torch.Tensor, batch: int,
                        num_splits: int) -> None:
    """Shape and integer checks shared by the decode wrappers."""
    if block_table.dim() != 2 or block_table.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"block_table {tuple(block_table.shape)} / seq_lens "
                         f"{tuple(seq_lens.shape)} do not match batch {batch}")
    if block_table.is_floating_point() or seq_lens.is_floating_point():
        raise ValueError("block_table and seq_lens must be integer tensors")
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    num_splits: int = 1, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; k_cache [num_blocks, block_size, Hkv, D] and v_cache
    [num_blocks, block_size, Hkv, Dv] (last dims contiguous; may be views of one
    [2, num_blocks, ...] cache); block_table [B, max_blocks] int32/int64; seq_lens [B]
    int32/int64; Hq a multiple of Hkv -> out [B, Hq, Dv] in q's dtype (written into ``out``
    when given). Accumulates in fp32; ``num_splits`` > 1 splits each context (flash-decoding).
    """
    B, Hq, D = q.shape
    _, page_size, Hkv, Dv = v_cache.shape
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != D or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)} / k_cache {tuple(k_cache.shape)} / v_cache "
                         f"{tuple(v_cache.shape)} do not fit together")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the head dimension of q, k_cache and v_cache must be contiguous")
    check_decode_inputs(block_table, seq_lens, B, num_splits)
    if out is None:
        out = q.new_empty(B, Hq, Dv)
    if B == 0:
        return out
    group = Hq // Hkv
    block_h = head_block(group)
    head_blocks = triton.cdiv(group, block_h)
    dest, lse = split_buffers(out, num_splits)
    _paged_decode_kernel[(B, Hkv * head_blocks, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, dest, lse,
        scale * LOG2E, page_size,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        dest.stride(0), dest.stride(1), dest.stride(2),
        lse.stride(0) if num_splits > 1 else 0, lse.stride(1) if num_splits > 1 else 0,
        GROUP=group, HEAD_BLOCKS=head_blocks,
        HEAD_DIM=D, V_DIM=Dv, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_DV=triton.next_power_of_2(Dv), BLOCK_H=block_h, BLOCK_N=PAGED_BLOCK_N,
        NUM_SPLITS=num_splits, DOT_UPCAST=dot_upcast(k_cache),
        DOT_PRECISION=dot_precision(k_cache),
        num_warps=NUM_WARPS,
    )
    combine_splits(dest, lse, out)
    return out


def paged_decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Twin of :func:`paged_decode_attention` (same shapes): the CPU path's reference
    (:func:`widellm.ops.cpu_attention.paged_decode_attention_reference`: gather each context,
    masked softmax attention in fp32) on the grouped view of q, with seq_len 0 rows set to
    zero (there the reference's softmax over no position is NaN). Runs on CPU copies, since
    that reference builds its position index on the CPU; the result returns to q's device."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    seq_lens = seq_lens.cpu().long()
    o = _grouped_reference(
        q.cpu().view(B, Hkv, Hq // Hkv, D), k_cache.cpu(), v_cache.cpu(),
        block_table.cpu().long(), seq_lens, scale,
    ).reshape(B, Hq, -1)
    return o.masked_fill((seq_lens == 0)[:, None, None], 0.0).to(q.device)
