"""Results flowing back from the model runner to the scheduler, and from the engine core to
the frontend. Plain lists, no tensors: these cross process boundaries (msgspec-encodable)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import msgspec


@dataclass(slots=True)
class LogprobsLists:
    """Per sampled token: candidate ids (column 0 is the sampled or prompt token itself), their
    logprobs, and the rank of the token (1 = most likely)."""

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def slice(self, start: int, end: int) -> "LogprobsLists":
        return LogprobsLists(
            self.logprob_token_ids[start:end], self.logprobs[start:end], self.ranks[start:end]
        )

    def as_tuples(self, limit: int | None = None) -> list[tuple[list[int], list[float], int]]:
        """(ids, logprobs, rank) per token, the first ``limit`` tokens (all when None)."""
        n = len(self.ranks) if limit is None else limit
        return [(self.logprob_token_ids[i], self.logprobs[i], self.ranks[i]) for i in range(n)]


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request: empty while its prompt is still being chunked in.
    sampled_token_ids: list[list[int]]
    logprobs: list[LogprobsLists | None] = field(default_factory=list)
    # req_id -> logprobs of the prompt positions computed this step (first position has none).
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Requests whose structured output is complete after this step's token.
    grammar_terminated: set[str] = field(default_factory=set)
    # Sampled ids still on their way to the host (worker/sampled_ids.py): ``pending()`` waits
    # for them; row ``r`` of ``sampled_token_ids`` is ``[pending()[j]]`` for each
    # ``(r, j)`` of ``pending_rows``. ``resolve`` fills them in.
    pending: Callable[[], list[int]] | None = None
    pending_rows: list[tuple[int, int]] = field(default_factory=list)

    def resolve(self) -> "ModelRunnerOutput":
        """Fill in the pending sampled ids (once; a no-op without any)."""
        if self.pending is not None:
            tokens = self.pending()
            for row, j in self.pending_rows:
                self.sampled_token_ids[row] = [tokens[j]]
            self.pending = None
        return self


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    # (ids, logprobs, rank) per new token when logprobs were asked for.
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    new_prompt_logprobs: list[tuple[list[int], list[float], int]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # A finished prompt's KV connector parameters (a prefill instance's answer).
    kv_transfer_params: dict | None = None
    # On the request's first output only (None after): when its engine core queued it and
    # first scheduled it, in seconds of that core's clock, the clock of the batch timestamps
    # its tokens arrive with, so the frontend's queue/prefill/decode intervals never mix
    # two processes' clocks.
    queued_ts: float | None = None
    scheduled_ts: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EplbStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Expert-load balance of an EP deployment as one rank measured it (all ranks agree).

    Balancedness = mean over max of the tokens each EP rank's experts computed, per MoE
    layer, averaged over layers (1.0 = perfectly even), over the last measurement window.
    """

    balancedness: float = 0.0  # latest measured window
    initial_balancedness: float = 0.0  # first measured window (before any rebalance)
    num_measurements: int = 0
    num_rebalances: int = 0  # placements fully applied
    num_failed_rebalances: int = 0  # abandoned part-way; the old placement stayed in force
    max_stall_s: float = 0.0  # longest step delay caused by moving one layer's weights
    total_stall_s: float = 0.0  # all step delays caused by moving expert weights, summed
    last_planned_balancedness: float = 0.0  # what the last plan expected on its window
    # (step, balancedness, rebalances applied by then) of the most recent measurements.
    history: list[tuple[int, float, int]] = []
    # Tokens the experts placed on each EP rank computed in the latest measured window,
    # summed over MoE layers (index = rank).
    rank_load: list[float] = []
