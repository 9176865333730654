"""Paged decode attention on CPUs: a C++ kernel (``cpu/paged_attention.cpp``) that reads K/V
in place from the paged cache, and its torch reference twin (gather the context, then plain
softmax attention).

The gather-then-attend path copies every sequence's whole context out of the cache each layer
and step, then reads it again; at batch 64 that is most of a small model's decode time. The
kernel reads each cached row once; in bf16 (16-row blocks, head sizes multiples of 32) it
multiplies the bf16 rows as they are stored (AVX512-BF16 dot products) and rounds the softmax
probabilities to bf16, as torch's CPU flash attention does. Where the kernels cannot be built
(see :mod:`widellm.ops.cpu_kernels`) callers use the reference path.

Causal prefill attention of a step's prompt chunks runs in one kernel call for all chunks
(``cpu/prefill_attention.cpp``): in bf16 with AMX tiles where the CPU has them (SmolLM2's
heads: ~1.7x torch SDPA at 128-256 tokens, ~1.3x at 2,048), AVX512-BF16 dot products on the
same packing elsewhere (AMD Zen 4/5); in fp32 (the serving dtype of CPUs without native bf16)
with AVX2 + FMA. :func:`prefill_attention_kernels` says whether one runs for a tensor;
:func:`prefill_attention_reference` is its twin, per chunk.
"""

from __future__ import annotations

import torch

from widellm.ops.cpu_kernels import load_cpu_kernels


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q [B, Hkv, G, Dk]; k_cache [num_blocks, block_size, Hkv, Dk] and v_cache
    [num_blocks, block_size, Hkv, Dv] (last dim contiguous; V may view K's storage);
    block_table [B, max_blocks] int64; seq_lens [B] int64 -> [B, Hkv, G, Dv] in q's dtype.
    Requires :func:`load_cpu_kernels` to have returned a module."""
    kernels = load_cpu_kernels()
    if kernels is None:
        raise RuntimeError("CPU attention kernels are not available")
    return kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, block_table,
                                          seq_lens, scale)


def paged_decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Same contract as :func:`paged_decode_attention`, in plain torch: gather each sequence's
    context, then masked softmax attention in fp32 (fp64 for fp64 inputs: a ground truth for
    tests)."""
    B, Hkv, G, _ = q.shape
    block_size = k_cache.shape[1]
    L = int(seq_lens.max()) if B else 0
    pos = torch.arange(L)
    blocks = block_table[:, (pos // block_size).clamp(max=block_table.shape[1] - 1)]  # [B, L]
    k = k_cache[blocks, pos % block_size]  # [B, L, Hkv, Dk]
    v = v_cache[blocks, pos % block_size]  # [B, L, Hkv, Dv]
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bhgd,blhd->bhgl", q.to(acc), k.to(acc)) * scale
    valid = pos[None, :] < seq_lens[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Rows past a sequence's end hold whatever the padding blocks hold: zero them, since a
    # zero probability times a non-finite value would still poison the sum.
    v = v.to(acc).masked_fill(~valid[:, :, None, None], 0.0)
    return torch.einsum("bhgl,blhd->bhgd", probs, v).to(q.dtype)


def prefill_attention_kernels(q: torch.Tensor, head_size: int, v_head_size: int):
    """The kernels module when its causal prefill kernel runs for ``q`` (on CPU: bf16 with AMX
    or AVX512-BF16 and head sizes multiples of 32, or fp32 with AVX2 + FMA and multiples of 8),
    else None: callers then take their torch SDPA path."""
    if q.device.type != "cpu":
        return None
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.prefill_attention_supported(head_size, v_head_size,
                                                                  q.dtype):
        return None
    return kernels


def prefill_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Twin of the kernels' ``prefill_attention``: q [Lq, H, Dk] at the last Lq of L positions,
    k [L, Hkv, Dk], v [L, Hkv, Dv] -> [Lq, H, Dv], causal, in torch SDPA."""
    Lq, L = q.shape[0], k.shape[0]
    allowed = torch.arange(L)[None, :] <= torch.arange(L - Lq, L)[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=allowed, scale=scale, enable_gqa=True,
    )
    return o.squeeze(0).transpose(0, 1)


def prefill_attention_batch(
    kernels, q: torch.Tensor, out: torch.Tensor,
    contexts: list[tuple[torch.Tensor, torch.Tensor]], query_start_loc: list[int], scale: float,
) -> None:
    """out [T, H, Dv] rows of every prompt chunk <- causal attention of q [T, H, Dk] over its
    context (keys [L, Hkv, Dk], values [L, Hkv, Dv]), all chunks in one call of the kernels
    module :func:`prefill_attention_kernels` returned; chunk c owns rows
    [query_start_loc[c], query_start_loc[c + 1])."""
    kernels.prefill_attention_batch(q, out, [k for k, _ in contexts], [v for _, v in contexts],
                                    query_start_loc, scale)
