"""The Triton KV store (widellm/ops/triton_kv_store.py) against its torch twin and the engine's
own store: rows land bit-exactly at their slots, -1 rows are neither read nor written, every
other cache slot keeps its bits."""

from __future__ import annotations

import pytest
import torch

from widellm.layers.kv_store import store_to_cache_reference
from widellm.ops.triton_kv_store import (
    store_kv_cache, store_kv_cache_reference, store_latent_cache, store_latent_cache_reference,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# The engine's default cache block; MLA caches also come in blocks of 64 (FlashMLA's).
BLOCK_SIZE = 16
MLA_BLOCK_SIZE = 64
NUM_BLOCKS = 5
# DeepSeek-V3's latent row: kv_lora_rank + qk_rope_head_dim.
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
# Every third row is padding (slot -1), interleaved with real rows.
PADDING_EVERY = 3


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of t, so NaNs and signed zeros compare as stored."""
    return t.contiguous().view(torch.uint8)


def _slots(num_tokens: int, num_slots: int, seed: int) -> torch.Tensor:
    """[num_tokens] int64 distinct random slots, every PADDING_EVERY-th one -1."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    slots[::PADDING_EVERY] = -1
    return slots


def _poison_padding(rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Padding rows hold garbage (NaN) that must never reach the cache."""
    rows[slots < 0] = float("nan")


def _assert_store(after: torch.Tensor, before: torch.Tensor, expected: torch.Tensor,
                  slots: torch.Tensor) -> None:
    """after == the twin's result bit for bit, and slots nobody wrote kept their bits."""
    assert torch.equal(_bits(after), _bits(expected))
    flat_after, flat_before = after.flatten(0, 1), before.flatten(0, 1)
    untouched = torch.ones(flat_after.shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    untouched = untouched.to(after.device)
    assert torch.equal(_bits(flat_after[untouched]), _bits(flat_before[untouched]))
    assert not torch.isnan(after.float()).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 64), (3, 3, 80)])
def test_store_kv_cache_matches_twin(device, dtype, num_heads, num_kv_heads, head_dim):
    """Engine layout [2, blocks, block_size, kv_heads, head_dim]; k and v are strided views of
    a fused qkv projection; non-power-of-two head counts and sizes exercise the masks."""
    torch.manual_seed(0)
    num_tokens = 23
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim).to(dtype)
    kv_cache = kv_cache.to(device)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype).to(device)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    key = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
    slots = _slots(num_tokens, NUM_BLOCKS * BLOCK_SIZE, seed=1).to(device)
    _poison_padding(qkv, slots)

    expected = kv_cache.clone()
    store_kv_cache_reference(key, value, expected[0], expected[1], slots)
    out = kv_cache.clone()
    store_kv_cache(key, value, out[0], out[1], slots)
    _assert_store(out[0], kv_cache[0], expected[0], slots)
    _assert_store(out[1], kv_cache[1], expected[1], slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_lora_rank, rope_dim", [(KV_LORA_RANK, QK_ROPE_HEAD_DIM), (96, 24)])
def test_store_latent_cache_matches_twin(device, dtype, kv_lora_rank, rope_dim):
    """MLA's latent cache [blocks, block_size, kv_lora_rank + rope]: c_kv then k_pe, both
    strided views of the kv_a projection's output; DeepSeek-V3's 512 + 64 and a small
    non-power-of-two pair."""
    torch.manual_seed(0)
    num_tokens = 19
    cache = torch.randn(NUM_BLOCKS, MLA_BLOCK_SIZE, kv_lora_rank + rope_dim).to(dtype)
    cache = cache.to(device)
    kv_a = torch.randn(num_tokens, kv_lora_rank + rope_dim).to(dtype).to(device)
    kv_c, k_pe = kv_a[:, :kv_lora_rank], kv_a[:, kv_lora_rank:]
    slots = _slots(num_tokens, NUM_BLOCKS * MLA_BLOCK_SIZE, seed=2).to(device)
    _poison_padding(kv_a, slots)

    expected = cache.clone()
    store_latent_cache_reference(kv_c, k_pe, expected, slots)
    out = cache.clone()
    store_latent_cache(kv_c, k_pe, out, slots)
    _assert_store(out, cache, expected, slots)


def test_twins_match_the_engine_store(device):
    """The twins are the engine's store: its index_copy_ into the flattened cache of the real
    rows (it drops the -1 padding before storing)."""
    torch.manual_seed(0)
    num_tokens, num_kv_heads, head_dim = 11, 2, 32
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, device=device)
    rows = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    slots = _slots(num_tokens, NUM_BLOCKS * BLOCK_SIZE, seed=3).to(device)
    real = slots >= 0

    engine = cache.clone()
    store_to_cache_reference(engine.flatten(0, 1), slots[real], rows[real])
    twin, kernel = cache.clone(), cache.clone()
    store_kv_cache_reference(rows, rows, twin, twin.clone(), slots)
    store_kv_cache(rows, rows, kernel, kernel.clone(), slots)
    assert torch.equal(twin, engine)
    assert torch.equal(kernel, engine)


def test_empty_and_all_padding_steps_leave_the_cache(device):
    """No rows, or only -1 rows (a dummy batch): the cache keeps every bit."""
    cache = torch.randn(NUM_BLOCKS, MLA_BLOCK_SIZE, KV_LORA_RANK + QK_ROPE_HEAD_DIM,
                        device=device).to(torch.bfloat16)
    before = cache.clone()
    for num_tokens in (0, 4):
        kv_c = torch.full((num_tokens, KV_LORA_RANK), float("nan"), device=device)
        k_pe = torch.full((num_tokens, QK_ROPE_HEAD_DIM), float("nan"), device=device)
        slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        store_latent_cache(kv_c.to(cache.dtype), k_pe.to(cache.dtype), cache, slots)
        assert torch.equal(_bits(cache), _bits(before))


def test_rejects_mismatched_inputs(device):
    """The copy keeps bits: a dtype other than the cache's, or rows of another shape, raise."""
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, 32, dtype=torch.bfloat16, device=device)
    rows = torch.zeros(3, 2, 32, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="dtype"):
        store_kv_cache(rows, rows, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="fit"):
        wide = torch.zeros(3, 2, 64, dtype=torch.bfloat16, device=device)
        store_kv_cache(wide, wide, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        bf16_rows = rows.to(torch.bfloat16)
        store_kv_cache(bf16_rows, bf16_rows, cache, cache.clone(), slots[:2])
