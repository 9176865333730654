"""A request as the engine core sees it: token ids and counters, no text, no tensors."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from widellm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Blocks allocated, prompt KV being loaded from a remote prefill (a KV connector).
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Ended by the engine, not by the request (a failed KV load under policy "fail").
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (or scheduled to be written
    this step); the request wants ``num_tokens - num_computed_tokens`` more computed.
    ``block_hashes[i]`` is the prefix-cache key of full block ``i`` of ``all_token_ids``
    (``widellm.core.block_hash``); ``cache_salt`` goes into the first block's key, so requests
    with different salts never share a cached block.
    With async scheduling, ``num_output_placeholders`` tokens are being sampled by steps in
    flight; the next step is scheduled as if they were known.
    ``grammar`` is the compiled constraint of a structured output (set before it is
    scheduled). ``kv_transfer_params`` are the KV connector's (``widellm.kv_transfer``): a prompt to
    hand to a remote decode, or to load from a remote prefill; ``num_external_tokens`` of its
    prompt were loaded that way.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "arrival_time",
        "output_token_ids", "all_token_ids", "num_computed_tokens", "num_cached_tokens",
        "block_hashes", "status", "stop_reason", "max_tokens", "num_preemptions",
        "num_output_placeholders", "cache_salt", "kv_transfer_params", "num_external_tokens",
        "grammar", "queued_ts", "scheduled_ts",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: "SamplingParams",
        eos_token_ids: frozenset[int],
        max_tokens: int,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        queued_ts: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit length, set on first scheduling
        self.block_hashes: list[bytes] = []
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Async scheduling: tokens being sampled by steps still in flight.
        self.num_output_placeholders = 0
        self.kv_transfer_params = kv_transfer_params
        self.num_external_tokens = 0
        # A structured output's compiled grammar, attached once compiled (engine core).
        self.grammar: Any = None
        # On the engine core's clock: when it queued the request, and when the scheduler
        # first admitted it (a preemption's re-admission keeps the first).
        self.queued_ts = queued_ts
        self.scheduled_ts: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
