"""A step's new K/V rows into the paged KV cache, as Triton kernels with their torch twins.

Row t goes to the flat slot ``slot_mapping[t] = block * block_size + offset``, i.e. to
``cache[block, offset]``; rows whose slot is -1 (any negative slot: the padding rows of a
padded step or CUDA-graph batch) are skipped, neither read nor written. That is the engine's
store (:func:`widellm.layers.attention.store_to_cache`, ``cpu/kv_store.cpp``), which stores the
first ``num_actual_tokens`` rows, the others being the -1 padding; the kernels need no row count.
Two layouts, as the engine allocates them:

* standard attention: ``k_cache``/``v_cache [num_blocks, block_size, num_kv_heads, head_dim]``
  (the engine's ``kv_cache[0]`` and ``kv_cache[1]``), key/value ``[T, num_kv_heads, head_dim]``;
* MLA (DeepSeek-V2/V3): one latent cache ``[num_blocks, block_size, kv_lora_rank +
  qk_rope_head_dim]`` holding ``c_kv`` then ``k_pe`` per token (512 + 64 for V3), written from
  ``kv_c [T, kv_lora_rank]`` and ``k_pe [T, qk_rope_head_dim]`` without concatenating them first.

Sources and caches may be strided views (k and v slice the fused qkv projection) as long as the
last dim is contiguous. The copy keeps the bits, so the source dtype must be the cache's (as for
the CPU kernel); an FP8 cache with scales is a separate kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Values one program moves per tensor at most: a tile of heads x head_dim (a whole token when
# it fits), enough to keep a GPU's loads wide without spilling registers.
MAX_TILE_ELEMENTS = 4096
# Slots below this are padding rows (-1 in the engine).
_FIRST_VALID_SLOT = tl.constexpr(0)


@triton.jit
def _load_slot(slot_mapping_ptr, token, block_size):
    """(int64 block, int64 offset in the block, bool: the slot is not padding) of a token."""
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    valid = slot >= _FIRST_VALID_SLOT
    slot = tl.maximum(slot, 0)  # keep the (masked) address of a padding row in bounds
    return slot // block_size, slot % block_size, valid


@triton.jit
def _extent(valid, size):
    """size, or 0 for a padding row: masks then come from index comparisons alone (the
    interpreter turns a scalar bool & a bool block into integers, which tl.load rejects)."""
    return tl.where(valid, size, 0)


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     num_heads, head_dim, block_size,
                     stride_key_t, stride_key_h, stride_value_t, stride_value_h,
                     stride_kc_block, stride_kc_offset, stride_kc_h,
                     stride_vc_block, stride_vc_offset, stride_vc_h,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (token, head block): key/value [BLOCK_H, BLOCK_D] of one token into its slot."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    block, offset, valid = _load_slot(slot_mapping_ptr, token, block_size)
    k_slot = block * stride_kc_block + offset * stride_kc_offset
    v_slot = block * stride_vc_block + offset * stride_vc_offset
    mask = (heads < _extent(valid, num_heads))[:, None] & (dims < head_dim)[None, :]
    k = tl.load(key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :],
                mask=mask)
    tl.store(k_cache_ptr + k_slot + heads[:, None] * stride_kc_h + dims[None, :], k, mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + heads[:, None] * stride_value_h
                + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + v_slot + heads[:, None] * stride_vc_h + dims[None, :], v, mask=mask)


@triton.jit
def _store_latent_kernel(kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr, kv_lora_rank,
                         rope_dim, block_size, stride_kv_c_t, stride_k_pe_t, stride_c_block,
                         stride_c_offset, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program per token: cache[slot] <- [kv_c[token] | k_pe[token]]."""
    token = tl.program_id(0).to(tl.int64)
    block, offset, valid = _load_slot(slot_mapping_ptr, token, block_size)
    slot = block * stride_c_block + offset * stride_c_offset
    lat = tl.arange(0, BLOCK_L)
    lat_mask = lat < _extent(valid, kv_lora_rank)
    c = tl.load(kv_c_ptr + token * stride_kv_c_t + lat, mask=lat_mask)
    tl.store(cache_ptr + slot + lat, c, mask=lat_mask)
    rope = tl.arange(0, BLOCK_R)
    rope_mask = rope < _extent(valid, rope_dim)
    pe = tl.load(k_pe_ptr + token * stride_k_pe_t + rope, mask=rope_mask)
    tl.store(cache_ptr + slot + kv_lora_rank + rope, pe, mask=rope_mask)


def _check(name: str, src: torch.Tensor, cache: torch.Tensor, row_shape: tuple) -> None:
    if src.dtype != cache.dtype:
        raise ValueError(f"{name}: dtype {src.dtype} differs from the cache's {cache.dtype}")
    if tuple(src.shape[1:]) != tuple(row_shape):
        raise ValueError(f"{name}: rows {tuple(src.shape[1:])} do not fit cache rows {row_shape}")
    if src.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim of the rows and of the cache must be contiguous")


def _check_slots(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32,
                                                                         torch.int64):
        raise ValueError(f"slot_mapping must be [{num_tokens}] int32/int64, got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim] <- key/value
    [T, num_kv_heads, head_dim] (the caches' dtype) at slot_mapping [T] int64 (-1: skip)."""
    T, num_heads, head_dim = key.shape
    _check("key", key, k_cache, k_cache.shape[2:])
    _check("value", value, v_cache, v_cache.shape[2:])
    if k_cache.shape != v_cache.shape or value.shape != key.shape:
        raise ValueError("store_kv_cache: key/value and k_cache/v_cache shapes must match")
    _check_slots(slot_mapping, T)
    if T == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, MAX_TILE_ELEMENTS // block_d))
    grid = (T, triton.cdiv(num_heads, block_h))
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping.contiguous(), num_heads, head_dim,
        k_cache.shape[1], key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_H=block_h, BLOCK_D=block_d)


def store_latent_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] <- kv_c [T, kv_lora_rank]
    and k_pe [T, qk_rope_head_dim] (the cache's dtype) side by side at slot_mapping [T] int64
    (-1: skip)."""
    T, kv_lora_rank = kv_c.shape
    rope_dim = k_pe.shape[-1]
    _check("kv_c", kv_c, cache, (kv_lora_rank,))
    _check("k_pe", k_pe, cache, (rope_dim,))
    if k_pe.shape[0] != T or cache.shape[2] != kv_lora_rank + rope_dim:
        raise ValueError(f"store_latent_cache: cache rows of {cache.shape[2]} values do not hold "
                         f"{kv_lora_rank} + {rope_dim} for {T} tokens")
    _check_slots(slot_mapping, T)
    if T == 0:
        return
    _store_latent_kernel[(T,)](
        kv_c, k_pe, cache, slot_mapping.contiguous(), kv_lora_rank, rope_dim, cache.shape[1],
        kv_c.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        BLOCK_L=triton.next_power_of_2(kv_lora_rank), BLOCK_R=triton.next_power_of_2(rope_dim))


# ---- plain torch twins -----------------------------------------------------------------------

def store_rows_reference(cache: torch.Tensor, slot_mapping: torch.Tensor,
                         rows: torch.Tensor) -> None:
    """cache [num_blocks, block_size, ...] <- rows [T, ...] at flat slots slot_mapping [T]
    (block = slot // block_size, offset = slot % block_size), rows with slot < 0 skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = cache.shape[1]
    cache[slots // block_size, slots % block_size] = rows[keep].to(cache.dtype)


def store_kv_cache_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Twin of :func:`store_kv_cache`."""
    store_rows_reference(k_cache, slot_mapping, key)
    store_rows_reference(v_cache, slot_mapping, value)


def store_latent_cache_reference(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                                 slot_mapping: torch.Tensor) -> None:
    """Twin of :func:`store_latent_cache`: the engine's concatenation, then the row store."""
    store_rows_reference(cache, slot_mapping, torch.cat([kv_c, k_pe], dim=-1))
