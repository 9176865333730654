"""What one engine core's output batch did, in the terms of the request-level metrics
(vLLM's V1 meanings): tokens, first-token and inter-token latencies, and the requests that
finished in it with their queue / prefill / decode / inference intervals.

A "request" here is one generated sequence (each sample of an ``n > 1`` request counts once,
as in vLLM); ``n`` itself and the longest sample are recorded per parent request. Intervals
between engine-side events use the engine core's own clock (the batch timestamps and a
request's ``queued_ts`` / ``scheduled_ts``), so they never mix two processes' clocks;
first-token and end-to-end latencies run from the frontend's arrival time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from widellm.core.outputs import EngineCoreOutput


@dataclass(slots=True)
class RequestTimes:
    """One sequence's engine-core timestamps, gathered across its outputs."""

    queued_ts: float | None = None
    scheduled_ts: float | None = None  # first admission; a preemption keeps the first
    first_token_ts: float | None = None  # the batch that ended its prefill
    last_token_ts: float | None = None  # the batch of its latest token
    prefilled: bool = False


@dataclass(slots=True)
class FinishedRequestStats:
    """A sequence that finished, with its intervals (None when it never ran: it ended
    before its engine core scheduled it, e.g. a grammar that failed to compile)."""

    finish_reason: str
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int | None
    queued_time_s: float | None = None
    prefill_time_s: float | None = None
    decode_time_s: float | None = None
    inference_time_s: float | None = None
    # Decode time over the tokens after the first; None below two tokens.
    mean_time_per_output_token_s: float | None = None


@dataclass(slots=True)
class IterationStats:
    """Filled by ``OutputProcessor.process_outputs`` for one batch of engine ``engine``
    stamped ``engine_ts`` (its core's clock); recorded by ``EngineMetrics``."""

    engine: int
    engine_ts: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    # (n, the longest of its samples in tokens) per parent request that finished.
    finished_parents: list[tuple[int, int]] = field(default_factory=list)

    def observe_output(self, times: RequestTimes, out: EngineCoreOutput, prompt_len: int,
                       since_arrival_s: float) -> None:
        """One engine output of a sequence: its prefill ends with the first output that
        carries a token or finishes it after it was scheduled; each later token batch is one
        inter-token gap."""
        if out.scheduled_ts is not None:
            times.queued_ts, times.scheduled_ts = out.queued_ts, out.scheduled_ts
        num_new = len(out.new_token_ids)
        self.num_generation_tokens += num_new
        if not (num_new or out.finished) or times.scheduled_ts is None:
            return  # a prompt chunk's logprobs, or ended before it ever ran
        if not times.prefilled:
            times.prefilled = True
            times.first_token_ts = self.engine_ts
            self.num_prompt_tokens += prompt_len
            if num_new:
                self.time_to_first_tokens_s.append(since_arrival_s)
        elif num_new:
            self.inter_token_latencies_s.append(self.engine_ts - times.last_token_ts)
        times.last_token_ts = self.engine_ts

    def observe_finished(self, times: RequestTimes, finish_reason: str, e2e_latency_s: float,
                         num_prompt_tokens: int, num_generation_tokens: int,
                         max_tokens: int | None) -> None:
        stats = FinishedRequestStats(finish_reason, e2e_latency_s, num_prompt_tokens,
                                     num_generation_tokens, max_tokens)
        scheduled, first, last = times.scheduled_ts, times.first_token_ts, times.last_token_ts
        if scheduled is not None and first is not None and last is not None:
            # (queued_ts is None only for a request made without the engine core's stamp)
            queued = scheduled if times.queued_ts is None else times.queued_ts
            stats.queued_time_s = scheduled - queued
            stats.prefill_time_s = first - scheduled
            stats.decode_time_s = last - first
            stats.inference_time_s = last - scheduled
            if num_generation_tokens > 1:
                stats.mean_time_per_output_token_s = (last - first) / (num_generation_tokens - 1)
        self.finished.append(stats)
