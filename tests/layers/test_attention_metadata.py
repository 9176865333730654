"""Padding a step's attention metadata (prompt steps run padded to a multiple of rows, see
SchedulerConfig.prefill_pad_multiple): exact slots, masks and row counts, and attention that
leaves the padding rows zero and the real rows as they were."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from widellm.config import SchedulerConfig, default_prefill_pad_multiple
from widellm.forward_context import set_forward_context
from widellm.layers.attention import Attention
from widellm.layers.attention_metadata import (
    build_attention_metadata, dummy_attention_metadata, metadata_to, pad_attention_metadata,
)

BLOCK_SIZE = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _metadata():
    """One decode (context 6) and one 5-token prompt: 6 rows, blocks [3, 1] and [0, 2]."""
    query_lens = np.array([1, 5])
    context_lens = np.array([6, 5])
    positions = np.array([5, 0, 1, 2, 3, 4])
    block_table = np.array([[3, 1], [0, 2]])
    return build_attention_metadata(query_lens, context_lens, positions, block_table, BLOCK_SIZE)


def test_pad_attention_metadata_rows():
    md = _metadata()
    assert md.slot_mapping.tolist() == [5, 0, 1, 2, 3, 8]
    padded = pad_attention_metadata(md, 8)
    assert padded.num_tokens == 8 and padded.num_actual_tokens == 6
    assert padded.slot_mapping.tolist() == [5, 0, 1, 2, 3, 8, -1, -1]
    assert padded.padding_mask.tolist() == [False] * 6 + [True] * 2
    assert padded.num_decodes == 1 and padded.prefill_query_start_loc == [1, 6]
    assert md.num_tokens == 6 and md.padding_mask is None  # the original is untouched
    with pytest.raises(ValueError, match="padded already"):
        pad_attention_metadata(padded, 16)
    with pytest.raises(ValueError, match="4 rows < 6 tokens"):
        pad_attention_metadata(md, 4)
    dummy = dummy_attention_metadata(3)
    assert dummy.num_actual_tokens == 0 and dummy.padding_mask.tolist() == [True] * 3


def test_attention_skips_padding_rows():
    """Same real rows and cache writes with and without two padding rows; padding output is 0
    and writes no slot."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(8, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(8, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(8, KV_HEADS, HEAD_DIM, generator=gen)
    outs, caches = [], []
    for md, rows in ((_metadata(), 6), (pad_attention_metadata(_metadata(), 8), 8)):
        attn = Attention(HEADS, HEAD_DIM, KV_HEADS, HEAD_DIM ** -0.5)
        attn.kv_cache = torch.zeros(attn.kv_cache_shape(4, BLOCK_SIZE))
        attn.kv_cache[:, 3, :1] = 1.0  # the decode's cached positions 0..4 (block 3, then 1)
        with set_forward_context(md):
            outs.append(attn(q[:rows], k[:rows], v[:rows]))
        caches.append(attn.kv_cache)
    assert torch.equal(outs[1][:6], outs[0])
    assert torch.equal(outs[1][6:], torch.zeros(2, HEADS, HEAD_DIM))
    assert torch.equal(caches[1], caches[0])


def test_default_prefill_pad_multiple():
    assert [default_prefill_pad_multiple(n) for n in (1, 512, 1000, 2048, 4096, 8192)] == \
        [16, 16, 16, 32, 64, 128]
    with pytest.raises(ValueError, match="prefill_pad_multiple must be >= 0"):
        SchedulerConfig(prefill_pad_multiple=-1)


def test_metadata_moves_every_tensor_to_the_device():
    """What a GPU engine's eager steps do with the host-built metadata: every tensor moves
    (the decode slots and mask, the prompt chunks' context slots and masks, the padding mask),
    values and plain fields unchanged. ("meta" stands in for a GPU.)"""
    chunk = build_attention_metadata(np.array([1, 2]), np.array([6, 5]),
                                     np.array([5, 3, 4]), np.array([[3, 1], [0, 2]]), BLOCK_SIZE)
    md = pad_attention_metadata(chunk, 4)
    moved = metadata_to(md, "meta")
    tensors = [f for f in dir(md) if isinstance(getattr(md, f, None), torch.Tensor)]
    assert sorted(tensors) == ["decode_mask", "decode_slots", "padding_mask", "slot_mapping"]
    assert all(getattr(moved, f).device.type == "meta" for f in tensors)
    assert [p.context_slots.device.type for p in moved.prefills] == ["meta"]
    assert [p.mask.device.type for p in moved.prefills] == ["meta"]
    assert (moved.num_tokens, moved.num_decodes, moved.num_actual_tokens) == (4, 1, 3)
    assert md.slot_mapping.device.type == "cpu"  # the host form is left as it was
    dummy = dummy_attention_metadata(2, "meta")
    assert dummy.slot_mapping.device.type == dummy.padding_mask.device.type == "meta"
