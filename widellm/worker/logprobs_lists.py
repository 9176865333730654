"""Sampler logprob tensors as the plain lists that cross to the scheduler, and the prompt
logprobs of a step's prompt positions."""

from __future__ import annotations

import numpy as np
import torch

from widellm.core.outputs import LogprobsLists
from widellm.worker.input_batch import BatchInputs, CachedRequestState
from widellm.worker.sampler import LogprobsTensors, compute_logprobs, gather_logprobs


def compute_prompt_logprobs(
    model: torch.nn.Module, states: dict[str, CachedRequestState], batch: BatchInputs,
    hidden: torch.Tensor, query_end: np.ndarray,
) -> dict[str, LogprobsLists]:
    """Logprob of each prompt token given the tokens before it, for the prompt positions
    computed this step (position p predicts token p + 1)."""
    result: dict[str, LogprobsLists] = {}
    for row, req_id in enumerate(batch.req_ids):
        state = states[req_id]
        n = state.sampling_params.prompt_logprobs
        start = int(batch.context_lens[row] - batch.query_lens[row])
        end = min(int(batch.context_lens[row]), state.num_prompt_tokens - 1)
        if n is None or start >= end:
            continue
        first = int(query_end[row] - batch.query_lens[row])
        logits = model.compute_logits(hidden[first:first + end - start])
        targets = torch.tensor(state.token_ids[start + 1:end + 1], dtype=torch.int64)
        lp = gather_logprobs(compute_logprobs(logits), targets, n)
        result[req_id] = to_lists(lp, 0, end - start, n)
    return result


def to_lists(lp: LogprobsTensors, start: int, end: int, num: int) -> LogprobsLists:
    return LogprobsLists(
        logprob_token_ids=lp.logprob_token_ids[start:end, : num + 1].tolist(),
        logprobs=lp.logprobs[start:end, : num + 1].tolist(),
        ranks=lp.selected_token_ranks[start:end].tolist(),
    )
