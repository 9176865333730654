"""What the scheduler tells the model runner each step: only what changed since the last one.

The runner keeps its own copy of each request (tokens, block table); a request appears here in
full once (``NewRequestData``, also after it resumes from preemption) and afterwards only as the
blocks it gained (``CachedRequestData``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from widellm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption; the runner recomputes their KV too.
    output_token_ids: list[int]
    sampling_params: "SamplingParams"
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int
    # The compiled grammar of a structured output (``structured_output.backend``), or None.
    grammar: Any = None


@dataclass(slots=True)
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step; dict order is the batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests whose runner state must be dropped before this step runs.
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    # Streamed prompts (disaggregated prefill): req_id -> its prompt tokens in the KV cache
    # once this step ran, so the connector can send each layer as soon as it is written.
    kv_stream_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def has_prompt_tokens(self) -> bool:
        """Some request computes prompt (or recomputed) tokens this step: it is new, or gets
        more than one token (with no speculative decoding, only a prompt chunk does)."""
        return (bool(self.scheduled_new_reqs)
                or self.total_num_scheduled_tokens > len(self.num_scheduled_tokens))
