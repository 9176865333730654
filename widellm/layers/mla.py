"""Multi-head Latent Attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

The cache holds, per token, the normalised latent ``c_kv`` (``kv_lora_rank`` values) and the
rotated shared key ``k_pe`` (``qk_rope_head_dim`` values): ``[num_blocks, block_size,
kv_lora_rank + qk_rope_head_dim]``, not per-head K/V.

* Prefill chunks expand the latents with ``kv_b_proj`` into per-head keys and values and run
  ordinary causal attention (compute-bound; expansion is cheaper than absorbing there).
* Decodes use weight absorption: ``q_nope`` is folded through ``W_UK`` into latent space, so
  scores are ``[q_lat, q_pe] . [c_kv, k_pe]`` (one 576-wide "head" shared by all query heads),
  the output is a mix of latents, and ``W_UV`` maps it back per head. No K/V is expanded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from widellm.forward_context import get_forward_context
from widellm.layers.attention import gather_from_cache, zero_padding_rows
from widellm.layers.attention_backend import AttentionBackend, CpuAttentionBackend
from widellm.layers.attention_metadata import AttentionMetadata
from widellm.layers.linear import Linear
from widellm.ops.cpu_attention import prefill_attention_batch, prefill_attention_kernels
from widellm.ops.cpu_kernels import load_cpu_kernels


class MLAAttention(nn.Module):
    # Decode form (asked by the model runner after loading): in place, through the AMX MLA
    # kernel, where it runs (bf16, AMX, cache blocks of 16 tokens): 1.2 vs ~4.7 ms per
    # layer for the gather + bmm form at 64 sequences x ~150 positions. Without it the gather
    # form: with 16+ query heads sharing one 576-wide latent, decode is compute-bound, and the
    # absorbed bmm on the gathered context (oneDNN, AMX) beat the generic in-place kernel's
    # fp32 FMAs (6.0 vs 10.7 ms per layer at 64 sequences x 256 positions).

    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
        kv_b_proj: Linear,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        # Shared with the model (it owns and loads the weight); a list hides it from
        # named_parameters so it is not registered twice.
        self._kv_b_proj = [kv_b_proj]
        self.kv_cache = torch.empty(0)
        self.w_uk: torch.Tensor | None = None  # [H, nope, kv_lora_rank]
        self.w_uv_t: torch.Tensor | None = None  # [H, kv_lora_rank, v_head_dim]
        # Stores latents and runs decode; the model runner binds the engine's.
        self.attention_backend: AttentionBackend = CpuAttentionBackend()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.kv_lora_rank + self.qk_rope_head_dim)

    def process_weights_after_loading(self) -> None:
        """Split ``kv_b_proj`` [H*(nope+v), kv_lora] into the absorbed decode matrices."""
        w = self._kv_b_proj[0].dense_weight().view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        self.w_uk = w[:, : self.qk_nope_head_dim].contiguous()
        self.w_uv_t = w[:, self.qk_nope_head_dim:].transpose(1, 2).contiguous()

    def prefers_in_place_decode(self, block_size: int) -> bool:
        """In place only through the AMX MLA kernel (bf16, AMX, this block size); see the
        class comment."""
        return (self.w_uk is not None and self.w_uk.dtype == torch.bfloat16
                and self._amx_kernel_runs(block_size))

    def _amx_kernel_runs(self, block_size: int) -> bool:
        kernels = load_cpu_kernels()
        return kernels is not None and kernels.mla_decode_supported(
            block_size, self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank
        )

    def forward(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """q [T, H, nope+rope] (rope part rotated), kv_c [T, kv_lora] (normalised latent),
        k_pe [T, rope] (rotated) -> [T, H, v_head_dim]."""
        md: AttentionMetadata = get_forward_context().attn_metadata
        cache = self.kv_cache.flatten(0, 1)  # [slots, kv_lora + rope]
        self.attention_backend.store_latent(kv_c, k_pe, self.kv_cache, md)
        out = zero_padding_rows(q.new_empty(q.shape[0], self.num_heads, self.v_head_dim), md)
        if md.num_decodes and md.decode_block_table is not None:
            d = md.num_decodes
            out[:d] = self._decode_in_place(q[:d], md.decode_block_table, md.decode_seq_lens)
        elif md.num_decodes:
            d = md.num_decodes
            out[:d] = self._decode_absorbed(q[:d], gather_from_cache(cache, md.decode_slots),
                                            md.decode_mask)
        # Prompts with no cached context attend to their own new latents only: expand them
        # all with one kv_b_proj matmul (one call per prompt was ~3x slower at 32 x 128).
        fresh = [p for p in md.prefills if p.context_slots is None]
        if fresh:
            fresh_start = fresh[0].token_start
            kv_fresh = self._kv_b_proj[0](kv_c[fresh_start:fresh[-1].token_end])
        contexts = []
        for p in md.prefills:
            if p.context_slots is None:
                kv = kv_fresh[p.token_start - fresh_start:p.token_end - fresh_start]
                ctx_pe = k_pe[p.token_start:p.token_end]
            else:
                ctx = gather_from_cache(cache, p.context_slots)
                kv = self._kv_b_proj[0](ctx[:, : self.kv_lora_rank])
                ctx_pe = ctx[:, self.kv_lora_rank:]
            contexts.append(self._expand_context(kv, ctx_pe))
        if not contexts:
            return out
        kernels = prefill_attention_kernels(q, contexts[0][0].shape[-1], self.v_head_dim)
        if kernels is not None:  # causal over each context, every chunk in one call
            prefill_attention_batch(kernels, q, out, contexts, md.prefill_query_start_loc,
                                    self.scale)
            return out
        for p, (k, v) in zip(md.prefills, contexts):
            out[p.token_start:p.token_end] = self._prefill_sdpa(
                q[p.token_start:p.token_end], k, v, p.mask)
        return out

    def _expand_context(
        self, kv: torch.Tensor, ctx_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """kv [L, H * (nope + v)] (the context's latents through kv_b_proj), ctx_pe [L, rope]
        -> per-head keys [L, H, nope+rope] and values [L, H, v]."""
        L = kv.shape[0]
        kv = kv.view(L, self.num_heads, -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, ctx_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        return k, v

    def _prefill_sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """q [q, H, nope+rope], k [L, H, nope+rope], v [L, H, v] -> [q, H, v] in torch SDPA,
        the twin of the prefill kernel."""
        # Zero-pad v to the q/k head size: torch's fused CPU attention kernel needs equal head
        # sizes, and without it SDPA falls back to its slow unfused path.
        pad = k.shape[-1] - self.v_head_dim
        if pad > 0:
            v = F.pad(v, (0, pad))
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
            scale=self.scale,
        )
        return o.squeeze(0).transpose(0, 1)[..., : self.v_head_dim]

    def _absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """q [D, H, nope+rope] -> [D, H, kv_lora+rope]: q_nope folded through W_UK."""
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [D, H, kv_lora]
        return torch.cat([q_lat, q_pe], dim=-1)

    def _decode_in_place(
        self, q: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """q [D, H, nope+rope] -> [D, H, v], reading the latent cache in place: one shared
        576-wide key head for all H query heads, values = its first kv_lora_rank columns.
        The attention backend's MLA decode (its reference twin is :meth:`_decode_absorbed`):
        on CPU the AMX kernel where it runs, else the generic paged decode kernel (slower
        than the gather form, so reached only when a caller asks for the in-place form)."""
        q_cat = self._absorb_query(q)  # [D, H, kv_lora+rope]
        o_lat = self.attention_backend.mla_decode(q_cat, self.kv_cache, block_table, seq_lens,
                                                  self.kv_lora_rank, self.scale)
        return torch.bmm(o_lat.transpose(0, 1), self.w_uv_t).transpose(0, 1)

    def _decode_absorbed(
        self, q: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [D, H, nope+rope], ctx [D, L, kv_lora+rope], mask [D, 1, 1, L] -> [D, H, v].

        All H query heads share one latent "key head", so scores are a plain batched matmul
        with H as the row dimension (no per-head expansion of the context)."""
        q_cat = self._absorb_query(q)  # [D, H, kv_lora+rope]
        scores = torch.bmm(q_cat, ctx.transpose(1, 2)).float() * self.scale  # [D, H, L]
        scores.masked_fill_(~mask[:, 0], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(ctx.dtype)
        o_lat = torch.bmm(probs, ctx[..., : self.kv_lora_rank])  # [D, H, kv_lora]
        return torch.bmm(o_lat.transpose(0, 1), self.w_uv_t).transpose(0, 1)
