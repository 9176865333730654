"""The model runner's copy of each request, and the flattened batch built from them.

The scheduler sends only diffs; this state is what they apply to. ``token_ids`` holds prompt
and output tokens as the runner knows them (it appends what it samples itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from widellm.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(slots=True)
class BatchInputs:
    """One step's flattened batch. Rows (requests) are ordered decodes first."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [T] int64
    positions: np.ndarray  # [T] int64
    query_lens: np.ndarray  # [B]
    context_lens: np.ndarray  # [B] computed tokens after this step
    block_table: np.ndarray  # [B, max_blocks]
    # Rows that reach the end of their known tokens this step and so sample one.
    sample_rows: list[int] = field(default_factory=list)


def build_batch_inputs(
    states: dict[str, CachedRequestState], num_scheduled: dict[str, int]
) -> BatchInputs:
    # Decodes first: the attention metadata batches them into one call.
    order = sorted(num_scheduled, key=lambda r: num_scheduled[r] != 1)
    query_lens = np.fromiter((num_scheduled[r] for r in order), np.int64, len(order))
    starts = np.fromiter((states[r].num_computed_tokens for r in order), np.int64, len(order))
    context_lens = starts + query_lens
    max_blocks = max((len(states[r].block_ids) for r in order), default=0)
    block_table = np.zeros((len(order), max(max_blocks, 1)), dtype=np.int64)
    ids: list[int] = []
    sample_rows = []
    for i, r in enumerate(order):
        st = states[r]
        block_table[i, : len(st.block_ids)] = st.block_ids
        ids.extend(st.token_ids[starts[i]:context_lens[i]])
        if context_lens[i] == len(st.token_ids):
            sample_rows.append(i)
    positions = np.concatenate([np.arange(s, c) for s, c in zip(starts, context_lens)])
    return BatchInputs(
        req_ids=order,
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=positions.astype(np.int64),
        query_lens=query_lens,
        context_lens=context_lens,
        block_table=block_table,
        sample_rows=sample_rows,
    )


@dataclass
class ModelInput:
    """One step's forward inputs, built before the lockstep vote (which carries its rows).

    Attributes:
        batch: the flattened requests.
        attn_metadata: the attention metadata, padded to ``num_rows``.
        input_ids: ``[num_rows]`` int64, padding rows token 0.
        positions: ``[num_rows]`` int64, padding rows position 0.
        kv_stream_tokens: streamed prompts (disaggregated prefill) -> their prompt tokens in
            the KV cache once this forward ran (see ``SchedulerOutput.kv_stream_tokens``).
    """

    batch: BatchInputs
    attn_metadata: Any
    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_stream_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]
