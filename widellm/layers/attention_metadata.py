"""Per-step attention metadata for the paged KV cache, built once per step by the model runner
and shared by every layer.

The batch is flattened without padding: decode requests (one query token) first, then prefill
chunks. Decodes are batched into one call; each prefill chunk gets its own. Decodes come in
one of two forms: the block table and lengths, for a kernel that reads the paged cache in place
(``decode_block_table``), or a padded slot matrix and mask, for the gather-then-attend torch
path (``decode_slots``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


DECODE_LEN_BUCKET = 64


@dataclass(slots=True)
class PrefillSeq:
    """One prompt chunk: query tokens ``[token_start, token_end)`` of the batch, attending to
    ``context_len`` cached positions (the chunk included)."""

    token_start: int
    token_end: int
    context_len: int
    # Cache slot of every context position [context_len]; None when the chunk is the whole
    # context (no cached prefix): keys then come straight from the current step.
    context_slots: torch.Tensor | None
    # [q, context_len] True where attention is allowed; None means plain causal.
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding rows (only with a padding_mask)
    num_decodes: int  # decode tokens occupy rows [0, num_decodes)
    decode_slots: torch.Tensor | None  # [D, L] cache slot per context position (0 past the end)
    decode_mask: torch.Tensor | None  # [D, 1, 1, L] True where position < seq_len
    prefills: list[PrefillSeq]
    # In-place decode form (instead of decode_slots/mask): [D, max_blocks] int64 block ids and
    # [D] int64 context lengths.
    decode_block_table: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    # [T] bool, True for padding rows (dummy batches, padded prefill steps): MoE layers give
    # them expert id -1. None when the batch has no padding.
    padding_mask: torch.Tensor | None = None
    # Rows [num_actual_tokens, T) are padding (None: none are); their K/V is not stored.
    num_actual_tokens: int | None = None

    @property
    def prefill_query_start_loc(self) -> list[int]:
        """[len(prefills) + 1]: each prefill chunk's first batch row, then the last one's end
        (the chunks' rows follow each other)."""
        if not self.prefills:
            return []
        return [p.token_start for p in self.prefills] + [self.prefills[-1].token_end]


def build_attention_metadata(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    positions: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    decode_in_place: bool = False,
) -> AttentionMetadata:
    """query_lens/context_lens [B] (context = cached + new tokens after this step),
    positions [T] of the batch's tokens,
    block_table [B, max_blocks] physical block ids. Rows with query_len 1 come first; the
    rows after the first longer query are all treated as prefill chunks. ``decode_in_place``
    gives decodes the block-table form (see the module docstring)."""
    num_reqs = len(query_lens)
    # A one-token query is a decode whatever its origin (a prompt's last chunk can be one).
    is_decode = query_lens == 1
    num_decodes = num_reqs if is_decode.all() else int(np.argmin(is_decode))
    query_start = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    num_tokens = int(query_start[-1])

    # Slot of every (request, position) for the tokens computed this step.
    req_index = np.repeat(np.arange(num_reqs), query_lens)
    slot_mapping = block_table[req_index, positions // block_size] * block_size + positions % block_size

    decode_slots = decode_mask = decode_block_table = decode_seq_lens = None
    if num_decodes and decode_in_place:
        decode_block_table = torch.from_numpy(
            np.ascontiguousarray(block_table[:num_decodes], dtype=np.int64))
        decode_seq_lens = torch.from_numpy(context_lens[:num_decodes].astype(np.int64))
    elif num_decodes:
        ctx = context_lens[:num_decodes]
        # Padded to a bucket so the batched matmuls see few distinct shapes (CPU GEMM
        # libraries build a kernel per shape); masked positions cost little.
        max_len = -(-int(ctx.max()) // DECODE_LEN_BUCKET) * DECODE_LEN_BUCKET
        pos = np.arange(max_len)
        valid = pos[None, :] < ctx[:, None]
        # Positions past a row's end read any valid block; the mask hides them.
        block_idx = np.minimum(pos // block_size, block_table.shape[1] - 1)
        blocks = block_table[:num_decodes, block_idx]
        slots = np.where(valid, blocks * block_size + pos % block_size, 0)
        decode_slots = torch.from_numpy(slots.astype(np.int64))
        decode_mask = torch.from_numpy(valid)[:, None, None, :]

    prefills = []
    for r in range(num_decodes, num_reqs):
        q, c = int(query_lens[r]), int(context_lens[r])
        start, end = int(query_start[r]), int(query_start[r + 1])
        if q == c:
            prefills.append(PrefillSeq(start, end, c, None, None))
            continue
        pos = np.arange(c)
        slots = block_table[r, pos // block_size] * block_size + pos % block_size
        q_pos = np.arange(c - q, c)
        mask = pos[None, :] <= q_pos[:, None]
        prefills.append(PrefillSeq(
            start, end, c, torch.from_numpy(slots.astype(np.int64)), torch.from_numpy(mask)
        ))

    return AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=torch.from_numpy(slot_mapping.astype(np.int64)),
        num_decodes=num_decodes,
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        prefills=prefills,
        decode_block_table=decode_block_table,
        decode_seq_lens=decode_seq_lens,
    )


def pad_attention_metadata(md: AttentionMetadata, num_tokens: int) -> AttentionMetadata:
    """``md`` with padding rows ``[md.num_tokens, num_tokens)`` appended: no cache slot, in no
    query (attention leaves their output rows zero), expert id -1 in MoE layers."""
    if md.padding_mask is not None:
        raise ValueError("pad_attention_metadata: md is padded already")
    if num_tokens < md.num_tokens:
        raise ValueError(f"pad_attention_metadata: {num_tokens} rows < {md.num_tokens} tokens")
    return dataclasses.replace(
        md,
        num_tokens=num_tokens,
        slot_mapping=torch.cat([md.slot_mapping, torch.full(
            (num_tokens - md.num_tokens,), -1, dtype=torch.int64)]),
        padding_mask=torch.arange(num_tokens) >= md.num_tokens,
        num_actual_tokens=md.num_tokens,
    )


def dummy_attention_metadata(num_tokens: int = 1,
                             device: torch.device | str = "cpu") -> AttentionMetadata:
    """``num_tokens`` padding tokens in one causal prefill, writing nothing to the cache. One
    token is the batch a rank without work runs so that the expert-parallel collectives of
    every layer line up; larger ones warm the model up at start-up."""
    return AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        num_decodes=0,
        decode_slots=None,
        decode_mask=None,
        prefills=[PrefillSeq(0, num_tokens, num_tokens, None, None)],
        padding_mask=torch.ones(num_tokens, dtype=torch.bool, device=device),
        num_actual_tokens=0,
    )


def metadata_to(md: AttentionMetadata, device: torch.device | str) -> AttentionMetadata:
    """``md`` with every tensor on ``device`` (built on the host, used by a GPU's kernels)."""
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    fields = {f.name: move(getattr(md, f.name)) for f in dataclasses.fields(md)
              if isinstance(getattr(md, f.name), torch.Tensor)}
    prefills = [dataclasses.replace(p, context_slots=move(p.context_slots), mask=move(p.mask))
                for p in md.prefills]
    return dataclasses.replace(md, prefills=prefills, **fields)
