"""The token-balanced micro-batch split, checked by hand: the module docstring's example, a
padded prompt step, a step whose second half is padding only, and the dummy batch."""

from __future__ import annotations

import numpy as np
import torch

from widellm.forward_context import DPMetadata, micro_batch_rows
from widellm.layers.attention_metadata import build_attention_metadata, pad_attention_metadata
from widellm.worker.input_batch import BatchInputs, ModelInput
from widellm.worker.ubatch_split import split_dummy_batch, split_model_input

BLOCK = 16


def _input(num_padded: int | None = None) -> ModelInput:
    """A decode of A at position 8 (block 0), then B's 6-token prompt (block 1)."""
    batch = BatchInputs(
        req_ids=["A", "B"], input_ids=torch.arange(100, 107),
        positions=np.array([8, 0, 1, 2, 3, 4, 5]), query_lens=np.array([1, 6]),
        context_lens=np.array([9, 6]), block_table=np.array([[0], [1]]), sample_rows=[0, 1])
    md = build_attention_metadata(batch.query_lens, batch.context_lens, batch.positions,
                                  batch.block_table, BLOCK)
    ids, pos = batch.input_ids, torch.from_numpy(batch.positions)
    if num_padded is not None:
        md = pad_attention_metadata(md, num_padded)
        pad = torch.zeros(num_padded - 7, dtype=torch.int64)
        ids, pos = torch.cat([ids, pad]), torch.cat([pos, pad])
    return ModelInput(batch, md, ids, pos)


def test_micro_batch_rows_and_their_agreement():
    assert [micro_batch_rows(n) for n in (1, 2, 7, 8)] == [(1, 1), (1, 1), (4, 3), (4, 4)]
    agreed = DPMetadata((7, 1, 8))
    assert agreed.micro_batch(0) == DPMetadata((4, 1, 4))
    assert agreed.micro_batch(1) == DPMetadata((3, 1, 4))


def test_a_prompt_chunk_cut_in_two():
    first, second = split_model_input(_input(), BLOCK, False, DPMetadata((7, 1)))
    assert first.input_ids.tolist() == [100, 101, 102, 103]
    assert second.input_ids.tolist() == [104, 105, 106]
    assert second.positions.tolist() == [3, 4, 5]
    assert (first.dp_metadata, second.dp_metadata) == (DPMetadata((4, 1)), DPMetadata((3, 1)))
    md0, md1 = first.attn_metadata, second.attn_metadata
    # A's decode (context 9) and B's first 3 tokens, a whole-context chunk.
    assert md0.num_decodes == 1 and md0.decode_slots[0, :9].tolist() == list(range(9))
    assert [(p.token_start, p.token_end, p.context_len, p.context_slots)
            for p in md0.prefills] == [(1, 4, 3, None)]
    assert md0.slot_mapping.tolist() == [8, 16, 17, 18]
    # B's last 3 tokens attend to its first 3 as cached context, causally.
    (chunk,) = md1.prefills
    assert (md1.num_decodes, chunk.token_start, chunk.token_end, chunk.context_len) == (0, 0, 3, 6)
    assert chunk.context_slots.tolist() == [16, 17, 18, 19, 20, 21]
    assert chunk.mask.int().tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0],
                                         [1, 1, 1, 1, 1, 1]]
    assert md1.slot_mapping.tolist() == [19, 20, 21]
    assert md0.padding_mask is None and md1.padding_mask is None


def test_padding_stays_at_the_end():
    first, second = split_model_input(_input(num_padded=12), BLOCK, False, None)
    md0, md1 = first.attn_metadata, second.attn_metadata
    assert (md0.num_tokens, md1.num_tokens) == (6, 6)
    assert md0.padding_mask is None and md0.slot_mapping.tolist() == [8, 16, 17, 18, 19, 20]
    # B's last token (a one-token chunk: a decode at context 6), then 5 padding rows.
    assert md1.num_decodes == 1 and md1.num_actual_tokens == 1
    assert md1.padding_mask.tolist() == [False] + [True] * 5
    assert md1.slot_mapping.tolist() == [21, -1, -1, -1, -1, -1]
    assert first.dp_metadata is None


def test_second_half_all_padding_and_the_dummy_batch():
    inp = _input(num_padded=16)  # 7 real rows, 9 padding: the cut (8) is past the last real
    first, second = split_model_input(inp, BLOCK, False, None)
    assert first.attn_metadata.num_actual_tokens == 7
    assert first.attn_metadata.padding_mask.tolist() == [False] * 7 + [True]
    assert second.attn_metadata.padding_mask.tolist() == [True] * 8
    assert second.attn_metadata.slot_mapping.tolist() == [-1] * 8
    dummies = split_dummy_batch(1, DPMetadata((1, 9)))
    assert [d.input_ids.tolist() for d in dummies] == [[0], [0]]
    assert [d.dp_metadata for d in dummies] == [DPMetadata((1, 5)), DPMetadata((1, 4))]
    assert all(d.attn_metadata.padding_mask.tolist() == [True] for d in dummies)
