"""Token-balanced split of one step's forward into the two micro-batches of dual-batch overlap.

Rows ``[0, s)`` go to the first micro-batch and ``[s, N)`` to the second, with ``s`` from
:func:`widellm.forward_context.micro_batch_rows` (so every rank knows every other rank's halves
from its vote). A request whose rows straddle ``s`` is cut in two chunks, exactly as chunked
prefill would cut it over two steps: the first attends to its cached context plus its own
rows, the second to all of that plus its own rows. Padding rows stay at the end (the second
micro-batch, or both when padding is more than half the rows).

Example (block size 16): a decode of request A (context 9), then a 6-token prompt chunk of B
starting at position 0; ``N = 7`` rows, ``s = 4``::

    rows          A0 | B0 B1 B2 | B3 B4 B5
    micro-batch 0 A (q 1, context 9), B (q 3, context 3)
    micro-batch 1 B (q 3, context 6): attends to B0-B2, which micro-batch 0 wrote
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from widellm.forward_context import DPMetadata, micro_batch_rows
from widellm.layers.attention_metadata import (
    build_attention_metadata, dummy_attention_metadata, pad_attention_metadata,
)
from widellm.worker.input_batch import ModelInput


@dataclass
class MicroBatch:
    """One micro-batch's forward: ``input_ids`` / ``positions`` ``[rows]`` int64, its
    attention metadata and the ranks' agreement for it (None on one rank)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: Any
    dp_metadata: DPMetadata | None


def split_model_input(inp: ModelInput, block_size: int, decode_in_place: bool,
                      dp_metadata: DPMetadata | None) -> list[MicroBatch]:
    """The two micro-batches of ``inp`` (see the module docstring)."""
    batch = inp.batch
    first_rows, _ = micro_batch_rows(inp.num_rows)
    num_real = int(batch.query_lens.sum())
    cut = min(first_rows, num_real)  # real rows of the first micro-batch
    query_start = np.concatenate([[0], np.cumsum(batch.query_lens)])
    # Each request's rows inside [0, cut) and [cut, num_real).
    q_first = np.clip(cut - query_start[:-1], 0, batch.query_lens)
    q_second = batch.query_lens - q_first
    pieces = []
    for index, (lo, hi, query_lens) in enumerate(
            ((0, first_rows, q_first), (first_rows, inp.num_rows, q_second))):
        # The first piece of a cut request ends where the second begins.
        context_lens = batch.context_lens - (q_second if index == 0 else 0)
        md = _piece_metadata(query_lens, context_lens, batch.positions[min(lo, num_real):
                             min(hi, num_real)], batch.block_table, block_size,
                             decode_in_place, hi - lo)
        pieces.append(MicroBatch(
            input_ids=inp.input_ids[lo:hi], positions=inp.positions[lo:hi], attn_metadata=md,
            dp_metadata=dp_metadata.micro_batch(index) if dp_metadata is not None else None,
        ))
    return pieces


def split_dummy_batch(num_rows: int, dp_metadata: DPMetadata | None) -> list[MicroBatch]:
    """The micro-batches of a dummy batch of ``num_rows`` padding rows: each half (at least one
    row, see :func:`micro_batch_rows`) is padding only, writing no KV slot."""
    pieces = []
    for index, rows in enumerate(micro_batch_rows(num_rows)):
        zeros = torch.zeros(rows, dtype=torch.int64)  # token 0 at position 0
        pieces.append(MicroBatch(
            input_ids=zeros, positions=zeros, attn_metadata=dummy_attention_metadata(rows),
            dp_metadata=dp_metadata.micro_batch(index) if dp_metadata is not None else None,
        ))
    return pieces


def _piece_metadata(query_lens: np.ndarray, context_lens: np.ndarray, positions: np.ndarray,
                    block_table: np.ndarray, block_size: int, decode_in_place: bool,
                    num_rows: int) -> Any:
    """Attention metadata of the requests with rows in this piece, padded to ``num_rows``."""
    keep = query_lens > 0
    if not keep.any():
        return dummy_attention_metadata(num_rows)
    md = build_attention_metadata(query_lens[keep], context_lens[keep], positions,
                                  block_table[keep], block_size, decode_in_place)
    return pad_attention_metadata(md, num_rows) if num_rows > md.num_tokens else md
