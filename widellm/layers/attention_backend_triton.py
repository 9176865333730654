"""The Triton attention backend: the kernels of ``widellm.ops`` behind the backend seam
(``attention_backend.py``). Decode always reads the paged cache in place."""

from __future__ import annotations

from widellm.layers.attention_backend import AttentionBackend
from widellm.ops.triton_kv_store import store_kv_cache, store_latent_cache
from widellm.ops.triton_mla_decode import mla_decode_attention
from widellm.ops.triton_paged_decode import paged_decode_attention


class TritonAttentionBackend(AttentionBackend):
    in_place_decode = True

    def store_kv(self, key, value, kv_cache, md):
        store_kv_cache(key, value.to(kv_cache.dtype), kv_cache[0], kv_cache[1],
                       md.slot_mapping)

    def store_latent(self, kv_c, k_pe, cache, md):
        store_latent_cache(kv_c.to(cache.dtype), k_pe.to(cache.dtype), cache, md.slot_mapping)

    def paged_decode(self, q, k_cache, v_cache, block_table, seq_lens, scale):
        return paged_decode_attention(q.contiguous(), k_cache, v_cache, block_table, seq_lens,
                                      scale)

    def mla_decode(self, q_cat, cache, block_table, seq_lens, kv_lora_rank, scale):
        return mla_decode_attention(q_cat.contiguous(), cache, block_table, seq_lens,
                                    kv_lora_rank, scale)
