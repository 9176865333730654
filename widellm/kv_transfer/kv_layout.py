"""Reading and writing whole blocks of the paged KV cache, layer by layer.

A layer's cache has one dim that indexes blocks: 1 for multi-head attention's
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (keys and values), 0 for MLA's
``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` (the compressed latent, which is
what moves: a decode instance expands it itself). Both sides must have the same layout;
``describe`` is what they compare.
"""

from __future__ import annotations

import torch
from torch import nn


def block_dim_of(layer: nn.Module, block_size: int) -> int:
    """The dim of ``layer.kv_cache_shape`` that grows with the block count."""
    one, two = layer.kv_cache_shape(1, block_size), layer.kv_cache_shape(2, block_size)
    dims = [i for i, (a, b) in enumerate(zip(one, two)) if a != b]
    if len(dims) != 1:
        raise ValueError(f"cannot tell the block dim of {type(layer).__name__}'s KV cache")
    return dims[0]


def describe(caches: list[torch.Tensor], block_dims: list[int]) -> list[list]:
    """Per layer: [shape of one block (the block dim as 1), dtype name]."""
    out = []
    for cache, dim in zip(caches, block_dims):
        shape = list(cache.shape)
        shape[dim] = 1
        out.append([shape, str(cache.dtype).removeprefix("torch.")])
    return out


def layer_nbytes(cache: torch.Tensor, block_dim: int, num_blocks: int) -> int:
    """Bytes of ``num_blocks`` blocks of one layer."""
    return cache.element_size() * cache.numel() // cache.shape[block_dim] * num_blocks


def gather_blocks(cache: torch.Tensor, block_dim: int, block_ids: torch.Tensor) -> torch.Tensor:
    """One layer's blocks ``block_ids`` [k] as a contiguous uint8 tensor (the wire bytes)."""
    return cache.index_select(block_dim, block_ids).contiguous().view(-1).view(torch.uint8)


def scatter_blocks(cache: torch.Tensor, block_dim: int, block_ids: torch.Tensor,
                   data: torch.Tensor) -> None:
    """Write the wire bytes ``data`` (uint8, from :func:`gather_blocks`) into ``block_ids``."""
    shape = list(cache.shape)
    shape[block_dim] = len(block_ids)
    cache.index_copy_(block_dim, block_ids, data.view(cache.dtype).view(shape))
