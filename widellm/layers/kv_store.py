"""Writing a step's new K/V rows into a layer's paged cache on the CPU."""

from __future__ import annotations

import torch

from widellm.layers.attention_metadata import AttentionMetadata
from widellm.ops.cpu_kernels import load_cpu_kernels


def store_to_cache(cache: torch.Tensor, md: AttentionMetadata, values: torch.Tensor) -> None:
    """cache [num_slots, ...] <- values [T, ...] at rows md.slot_mapping [T], padding rows (the
    last T - md.num_actual_tokens) skipped: the kernels' one parallel pass of row copies where
    they are built and the dtypes match, else :func:`store_to_cache_reference`."""
    n = md.num_tokens if md.num_actual_tokens is None else md.num_actual_tokens
    kernels = load_cpu_kernels() if cache.device.type == "cpu" else None
    if kernels is not None and values.dtype == cache.dtype and values.stride(-1) == 1:
        kernels.store_kv_cache(values[:n], cache, md.slot_mapping[:n])
        return
    store_to_cache_reference(cache, md.slot_mapping[:n], values[:n])


def store_to_cache_reference(cache: torch.Tensor, slots: torch.Tensor,
                             values: torch.Tensor) -> None:
    """cache [num_slots, ...] <- values [n, ...] at rows slots [n] (index_copy_)."""
    cache.index_copy_(0, slots, values.to(cache.dtype))
