"""The attention backend seam: how attention layers write their K/V into the paged cache and
run decode against it. One backend per engine, chosen at start-up (``--attention-backend``)
and bound by the model runner to every attention layer; the layers' code (what is computed)
stays one definition for every device.

Backends:

- ``cpu``: widellm's C++ kernels (``widellm.ops.cpu_*``) where they are built, their torch
  twins elsewhere; decode reads the cache in place only where a kernel makes that faster
  (``prefers_in_place``), else the layers gather the context.
- ``triton`` (``attention_backend_triton.py``): the Triton kernels of ``widellm.ops``, the
  CUDA path; on CPU tensors they run in Triton's interpreter (``TRITON_INTERPRET=1``), which
  is how the tests check the wiring against the ``cpu`` backend.

Prefill attention stays in the layers (torch SDPA, or the CPU prefill kernels), as the
issue's first CUDA step allows.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch
from torch import nn

from widellm.layers.attention_metadata import AttentionMetadata
from widellm.layers.kv_store import store_to_cache
from widellm.ops.cpu_attention import paged_decode_attention
from widellm.ops.cpu_kernels import load_cpu_kernels

ATTENTION_BACKENDS = ("auto", "cpu", "triton")
TRITON_INTERPRET_ENV = "TRITON_INTERPRET"


class AttentionBackend(ABC):
    """Lifecycle: built once; per step, each layer stores its new K/V, then decodes.

    ``in_place_decode``: decode always reads the cache in place (block table and lengths),
    so the runner builds that form of the metadata; False leaves it to the layers' own
    preference (``prefers_in_place_decode``)."""

    in_place_decode: bool = False

    @abstractmethod
    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 md: AttentionMetadata) -> None:
        """kv_cache [2, blocks, block_size, Hkv, D] <- key/value [T, Hkv, D] at
        ``md.slot_mapping`` (padding rows, slot -1, skipped)."""

    @abstractmethod
    def store_latent(self, kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                     md: AttentionMetadata) -> None:
        """MLA: cache [blocks, block_size, R + P] <- kv_c [T, R] and k_pe [T, P] side by side
        at ``md.slot_mapping`` (padding rows skipped)."""

    @abstractmethod
    def paged_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
        """q [D, Hq, Dk]; k_cache [blocks, block_size, Hkv, Dk], v_cache [blocks, block_size,
        Hkv, Dv] (may share storage); block_table [D, max_blocks]; seq_lens [D]
        -> [D, Hq, Dv]; query head h reads KV head h // (Hq / Hkv)."""

    @abstractmethod
    def mla_decode(self, q_cat: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, kv_lora_rank: int, scale: float) -> torch.Tensor:
        """MLA over the latent cache: q_cat [D, H, R + P]; cache [blocks, block_size, R + P];
        keys are whole cache rows, values their first R columns -> [D, H, R]."""


class CpuAttentionBackend(AttentionBackend):
    def store_kv(self, key, value, kv_cache, md):
        store_to_cache(kv_cache[0].flatten(0, 1), md, key)
        store_to_cache(kv_cache[1].flatten(0, 1), md, value)

    def store_latent(self, kv_c, k_pe, cache, md):
        store_to_cache(cache.flatten(0, 1), md, torch.cat([kv_c, k_pe], dim=-1))

    def paged_decode(self, q, k_cache, v_cache, block_table, seq_lens, scale):
        d, hq, dk = q.shape
        grouped = q.view(d, k_cache.shape[2], hq // k_cache.shape[2], dk)
        out = paged_decode_attention(grouped, k_cache, v_cache, block_table, seq_lens, scale)
        return out.view(d, hq, -1)

    def mla_decode(self, q_cat, cache, block_table, seq_lens, kv_lora_rank, scale):
        kernels = load_cpu_kernels()
        if (q_cat.dtype == torch.bfloat16 and kernels is not None
                and kernels.mla_decode_supported(cache.shape[1], cache.shape[2], kv_lora_rank)):
            return kernels.mla_decode_attention(q_cat.contiguous(), cache, block_table,
                                                seq_lens, kv_lora_rank, scale)
        as_heads = cache.unsqueeze(2)  # [blocks, block_size, 1, R + P]: one shared KV head
        return self.paged_decode(q_cat, as_heads, as_heads[..., :kv_lora_rank], block_table,
                                 seq_lens, scale)


def resolve_attention_backend(name: str, on_cuda: bool) -> str:
    """``auto``: triton with CUDA, cpu otherwise. ``triton`` without CUDA needs Triton's
    interpreter (slow: for tests of the GPU path's wiring)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if on_cuda else "cpu"
    if name == "triton" and not on_cuda and os.environ.get(TRITON_INTERPRET_ENV) != "1":
        raise ValueError("attention_backend triton without a GPU runs Triton's interpreter: "
                         f"set {TRITON_INTERPRET_ENV}=1 (slow; meant for tests)")
    return name


def bind_attention_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Give every attention layer of ``model`` the engine's backend. The CPU decode stacks
    (``model/fused_decode.py``: whole decode steps in one C++ call, with the CPU kernels'
    attention inside) go with the CPU backend only."""
    for module in model.modules():
        if hasattr(module, "attention_backend"):
            module.attention_backend = backend
        if not isinstance(backend, CpuAttentionBackend) and hasattr(module, "fused_decode"):
            module.fused_decode = None


def make_attention_backend(name: str) -> AttentionBackend:
    """The backend of a resolved name (see :func:`resolve_attention_backend`)."""
    if name == "triton":
        from widellm.layers.attention_backend_triton import TritonAttentionBackend

        return TritonAttentionBackend()
    return CpuAttentionBackend()
