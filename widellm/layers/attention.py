"""Paged attention for multi-head / grouped-query models on the CPU: widellm's kernels for bf16
decode and prefill (:mod:`widellm.ops.cpu_attention`), torch SDPA otherwise (the reference).

KV cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (keys, values),
bound to the layer by the model runner as ``layer.kv_cache``. Every token's K/V is written
before any attention is computed, so requests in one step may read blocks another request of
the same step has just filled (prefix sharing between siblings).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from widellm.forward_context import get_forward_context
from widellm.layers.attention_backend import AttentionBackend, CpuAttentionBackend
from widellm.layers.attention_metadata import AttentionMetadata, PrefillSeq
from widellm.ops.cpu_attention import prefill_attention_batch, prefill_attention_kernels


def zero_padding_rows(out: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
    """out [T, ...] with the rows that are in no query (a padded step's padding) set to zero,
    so nothing uninitialised flows on; returns out."""
    end = md.prefill_query_start_loc[-1] if md.prefills else md.num_decodes
    if end < out.shape[0]:
        out[end:].zero_()
    return out


def gather_from_cache(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_slots, ...], slots [...] -> [..., ...] rows of the cache."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


class Attention(nn.Module):
    def prefers_in_place_decode(self, block_size: int) -> bool:
        """Decodes read the cache in place with the CPU kernel (any block size) when the
        model runner offers it."""
        return True

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache = torch.empty(0)
        # Stores K/V and runs decode; the model runner binds the engine's (see
        # attention_backend.py).
        self.attention_backend: AttentionBackend = CpuAttentionBackend()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
        md: AttentionMetadata = get_forward_context().attn_metadata
        k_cache = self.kv_cache[0].flatten(0, 1)  # [slots, Hkv, D]
        v_cache = self.kv_cache[1].flatten(0, 1)
        self.attention_backend.store_kv(k, v, self.kv_cache, md)
        out = zero_padding_rows(torch.empty_like(q), md)

        if md.num_decodes and md.decode_block_table is not None:
            d = md.num_decodes
            # Query heads of one KV group are adjacent (head h reads KV head h // G).
            out[:d] = self.attention_backend.paged_decode(
                q[:d], self.kv_cache[0], self.kv_cache[1], md.decode_block_table,
                md.decode_seq_lens, self.scale)
        elif md.num_decodes:
            d = md.num_decodes
            kd = gather_from_cache(k_cache, md.decode_slots).transpose(1, 2)  # [D, Hkv, L, Dh]
            vd = gather_from_cache(v_cache, md.decode_slots).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:d].unsqueeze(2), kd, vd, attn_mask=md.decode_mask, scale=self.scale,
                enable_gqa=True,
            )
            out[:d] = o.squeeze(2)

        if not md.prefills:
            return out
        kernels = prefill_attention_kernels(q, self.head_dim, self.head_dim)
        contexts = [self._prefill_context(p, k, v, k_cache, v_cache) for p in md.prefills]
        if kernels is not None:  # causal over each context, every chunk in one call
            prefill_attention_batch(kernels, q, out, contexts, md.prefill_query_start_loc,
                                    self.scale)
            return out
        for p, (ks, vs) in zip(md.prefills, contexts):
            qs = q[p.token_start:p.token_end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                attn_mask=p.mask, is_causal=p.mask is None, scale=self.scale, enable_gqa=True,
            )
            out[p.token_start:p.token_end] = o.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def _prefill_context(p: PrefillSeq, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [context_len, Hkv, D] a prompt chunk attends to: its own rows of
        this step when it is the whole context, else gathered from the cache."""
        if p.context_slots is None:
            return k[p.token_start:p.token_end], v[p.token_start:p.token_end]
        return (gather_from_cache(k_cache, p.context_slots),
                gather_from_cache(v_cache, p.context_slots))
