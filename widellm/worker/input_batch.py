"""The model runner's copy of each request, and the flattened batch built from them.

The scheduler sends only diffs; this state is what they apply to. ``token_ids`` holds prompt
and output tokens as the runner knows them (it appends what it samples itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from widellm.core.scheduler_output import SchedulerOutput
from widellm.sampling_params import SamplingParams
from widellm.structured_output.runner_grammars import RunnerGrammars


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
    # The capture size a decode step may replay a graph at (its rows are then loaded into
    # the step buffers; the padded host form is the eager fallback). None: runs eagerly.
    graph_size: int | None = None

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]


def apply_scheduler_output(states: dict[str, CachedRequestState],
                           generators: dict[str, torch.Generator], grammars: RunnerGrammars,
                           so: SchedulerOutput, device: str = "cpu") -> None:
    """Apply the scheduler's diffs to the runner's request states: drop finished and preempted
    requests, add new ones (a seeded request gets its generator on ``device`` once: it outlives
    preemption), extend the running ones' blocks and computed counts."""
    for req_id in so.finished_req_ids:
        states.pop(req_id, None)
        generators.pop(req_id, None)
        grammars.remove(req_id)
    for req_id in so.preempted_req_ids:
        states.pop(req_id, None)
        grammars.remove(req_id)
    for new in so.scheduled_new_reqs:
        params = new.sampling_params
        if params.seed is not None and new.req_id not in generators:
            generators[new.req_id] = torch.Generator(device=device).manual_seed(params.seed)
        states[new.req_id] = CachedRequestState(
            req_id=new.req_id,
            token_ids=new.prompt_token_ids + new.output_token_ids,
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=params,
            eos_token_ids=new.eos_token_ids,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
        )
        if new.grammar is not None:
            grammars.add(new.req_id, new.grammar, new.output_token_ids)
    cached = so.scheduled_cached_reqs
    for req_id, block_ids, num_computed in zip(
        cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
    ):
        state = states[req_id]
        state.block_ids.extend(block_ids)
        state.num_computed_tokens = num_computed
