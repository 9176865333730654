"""Sizing and allocating the paged KV cache.

Each attention layer declares ``kv_cache_shape(num_blocks, block_size)``; one block of the
pool holds ``block_size`` tokens in every layer at once, so its size is the sum over layers.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
from torch import nn

from widellm.worker.host_memory import AvailableMemory, host_available_memory


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    layers: tuple[nn.Module, ...]
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, model: nn.Module, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        layers = tuple(m for m in model.modules() if hasattr(m, "kv_cache_shape"))
        if not layers:
            raise ValueError("model has no attention layer with a KV cache")
        return cls(layers, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(m.kv_cache_shape(1, self.block_size)) for m in self.layers) * elem

    def num_blocks_for(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block


def available_memory(device: str = "cpu") -> AvailableMemory:
    """Memory the KV cache may come from: free device memory on CUDA; on CPU the host's
    MemAvailable or, where less, what this process's memory cgroups still allow."""
    if device == "cuda":
        return AvailableMemory(torch.cuda.mem_get_info()[0], "free CUDA memory")
    return host_available_memory()


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int,
                      device: str = "cpu") -> list[torch.Tensor]:
    """Zero-filled tensors bound to their layers as ``layer.kv_cache``.

    On CPU each comes from an anonymous mmap: the kernel hands out zero pages on first write,
    so a block costs resident memory only once a request writes into it and an idle server
    holds none of its pool. (``torch.zeros`` would not do: it writes every page to zero them,
    which makes the whole pool resident at start-up.)"""
    caches = []
    for layer in spec.layers:
        shape = layer.kv_cache_shape(num_blocks, spec.block_size)
        if device != "cpu":  # device memory: zeroed at once, not lazily mapped
            cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        else:
            cache = lazy_zeros(shape, spec.dtype)
        layer.kv_cache = cache
        caches.append(cache)
    return caches


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages are mapped on first touch. The tensor keeps the
    mapping alive (torch.frombuffer holds a reference to it); it is unmapped with the tensor."""
    elem = torch.empty((), dtype=dtype).element_size()
    num_bytes = math.prod(shape) * elem
    buf = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)
