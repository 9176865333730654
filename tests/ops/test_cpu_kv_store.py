"""The KV-cache store kernel against its reference (index_copy_), and the layers' choice."""

from __future__ import annotations

import pytest
import torch

from widellm.layers.kv_store import store_to_cache, store_to_cache_reference
from widellm.layers.attention_metadata import AttentionMetadata


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 700])
def test_store_kv_cache_equals_index_copy(kernels, dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    slots = 1000
    # A strided source, as v is a view of the fused qkv projection: [T, 3, 8] inside [T, 40].
    fused = (torch.randn(tokens, 40, generator=gen) * 50).to(dtype)
    src = fused[:, 16:].view(tokens, 3, 8)
    slot_mapping = torch.randperm(slots, generator=gen)[:tokens]
    cache = (torch.randn(slots, 3, 8, generator=gen) * 50).to(dtype)
    expected = cache.clone()
    store_to_cache_reference(expected, slot_mapping, src)
    kernels.store_kv_cache(src, cache, slot_mapping)
    assert torch.equal(cache, expected)


def test_store_kv_cache_rejects_bad_input(kernels):
    cache = torch.zeros(10, 2, 4)
    src = torch.ones(3, 2, 4)
    with pytest.raises(ValueError, match="out of range"):
        kernels.store_kv_cache(src, cache, torch.tensor([0, 10, 1]))
    with pytest.raises(ValueError, match="out of range"):
        kernels.store_kv_cache(src, cache, torch.tensor([0, -1, 1]))
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.store_kv_cache(src.bfloat16(), cache, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="must match"):
        kernels.store_kv_cache(torch.ones(3, 4, 2), cache, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.store_kv_cache(torch.ones(3, 4, 2).transpose(1, 2), cache, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="slot_mapping"):
        kernels.store_kv_cache(src, cache, torch.tensor([0, 1]))


def _metadata(slot_mapping: torch.Tensor, actual: int) -> AttentionMetadata:
    return AttentionMetadata(num_tokens=slot_mapping.shape[0], slot_mapping=slot_mapping,
                             num_decodes=0, decode_slots=None, decode_mask=None, prefills=[],
                             num_actual_tokens=actual)


def test_store_to_cache_skips_padding_rows(kernels):
    """The layers' store: padding rows past num_actual_tokens (slot -1) are not written, on the
    kernel's path (same dtype) and on the reference's (the cache in another dtype)."""
    values = torch.arange(5 * 6, dtype=torch.float32).view(5, 2, 3)
    slot_mapping = torch.tensor([7, 2, 4, -1, -1])
    for cache_dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros(8, 2, 3, dtype=cache_dtype)
        store_to_cache(cache, _metadata(slot_mapping, 3), values)
        expected = torch.zeros(8, 2, 3, dtype=cache_dtype)
        expected[[7, 2, 4]] = values[:3].to(cache_dtype)
        assert torch.equal(cache, expected)
