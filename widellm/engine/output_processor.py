"""Frontend side of outputs: engine-core token ids -> text, logprobs, stop strings and
``RequestOutput`` objects, for single requests and ``n > 1`` fan-outs.

A request with ``n > 1`` becomes ``n`` child requests in the engine core (``"{i}_{id}"``);
they share the prompt's KV blocks through the prefix cache, and their outputs are joined here.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from widellm.core.outputs import EngineCoreOutput
from widellm.engine.detokenizer import IncrementalDetokenizer
from widellm.engine.iteration_stats import IterationStats, RequestTimes
from widellm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from widellm.sampling_params import SamplingParams


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # whole text so far on every update
    DELTA = 1  # only what is new since the last update (streaming)
    FINAL_ONLY = 2  # one output, when finished (offline generate)


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


@dataclass
class _Sample:
    """One generated sequence (a child when n > 1)."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    finish_sent: bool = False  # DELTA mode: the finishing update went out already
    times: RequestTimes = field(default_factory=RequestTimes)


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: RequestOutputKind
    samples: list[_Sample]
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    prev_token_time: float | None = None  # last token time before the latest update
    last_token_time: float | None = None
    num_unfinished: int = 0
    kv_transfer_params: dict | None = None  # a prefill instance's answer for the decode

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kind: RequestOutputKind,
    ) -> list[str]:
        """Register a request; returns the engine-core request ids of its samples."""
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        samples = [
            _Sample(
                index=i,
                detokenizer=self._make_detokenizer(prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        self.parents[request_id] = _ParentState(
            request_id, prompt, prompt_token_ids, params, kind, samples,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            num_unfinished=params.n,
        )
        ids = [request_id] if params.n == 1 else [
            child_request_id(request_id, i) for i in range(params.n)
        ]
        for i, child in enumerate(ids):
            self.child_to_parent[child] = (request_id, i)
        return ids

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget parents; returns the engine-core ids to abort."""
        core_ids = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            for child, (pid, _) in list(self.child_to_parent.items()):
                if pid == rid:
                    core_ids.append(child)
                    del self.child_to_parent[child]
        return core_ids

    def process_outputs(
        self, outputs: list[EngineCoreOutput], iteration: IterationStats | None = None,
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs due now and engine-core ids to abort (stop strings).
        ``iteration``: one engine core's batch, to fill with what the metrics record."""
        now = time.monotonic()
        due: dict[str, _ParentState] = {}
        to_abort: list[str] = []
        for out in outputs:
            link = self.child_to_parent.get(out.request_id)
            if link is None:
                continue  # aborted meanwhile
            parent = self.parents[link[0]]
            sample = parent.samples[link[1]]
            if sample.finish_reason is not None:
                continue
            self._apply(parent, sample, out, now)
            if iteration is not None:
                self._observe(iteration, parent, sample, out, now)
            if sample.finish_reason is not None:
                parent.num_unfinished -= 1
                del self.child_to_parent[out.request_id]
                if not out.finished:
                    to_abort.append(out.request_id)  # stopped by a stop string here
            due[parent.request_id] = parent

        results = []
        for parent in due.values():
            if parent.kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
                continue
            results.append(self._make_output(parent))
            if parent.finished:
                del self.parents[parent.request_id]
                if iteration is not None:
                    iteration.finished_parents.append(
                        (len(parent.samples), max(len(s.token_ids) for s in parent.samples)))
        return results, to_abort

    # ---- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _observe(iteration: IterationStats, parent: _ParentState, sample: _Sample,
                 out: EngineCoreOutput, now: float) -> None:
        num_prompt = len(parent.prompt_token_ids)
        since_arrival = now - parent.arrival_time
        iteration.observe_output(sample.times, out, num_prompt, since_arrival)
        if sample.finish_reason is not None:
            iteration.observe_finished(sample.times, sample.finish_reason, since_arrival,
                                       num_prompt, len(sample.token_ids), parent.params.max_tokens)

    def _make_detokenizer(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer | None:
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens,
            params.include_stop_str_in_output,
        )

    def _apply(
        self, parent: _ParentState, sample: _Sample, out: EngineCoreOutput, now: float
    ) -> None:
        if out.new_token_ids:
            parent.first_token_time = parent.first_token_time or now
            parent.prev_token_time = parent.last_token_time
            parent.last_token_time = now
        parent.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            parent.kv_transfer_params = out.kv_transfer_params
        # Every sample of an n > 1 request computes the same prompt logprobs; keep one copy.
        if out.new_prompt_logprobs and parent.prompt_logprobs is not None and sample.index == 0:
            parent.prompt_logprobs.extend(self._logprob_dicts(out.new_prompt_logprobs))
        sample.token_ids.extend(out.new_token_ids)
        if out.new_logprobs and sample.logprobs is not None:
            dicts = self._logprob_dicts(out.new_logprobs)
            sample.logprobs.extend(dicts)
            sample.cumulative_logprob += sum(lp[1][0] for lp in out.new_logprobs)
        stop_str = None
        if sample.detokenizer is not None:
            stop_str = sample.detokenizer.update(out.new_token_ids)
        if stop_str is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop_str
        elif out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason

    def _logprob_dicts(
        self, entries: list[tuple[list[int], list[float], int]]
    ) -> list[dict[int, Logprob]]:
        result = []
        for ids, lps, rank in entries:
            d: dict[int, Logprob] = {}
            for j, (tid, lp) in enumerate(zip(ids, lps)):
                if tid not in d:
                    d[tid] = Logprob(lp, rank if j == 0 else j, self._decode_one(tid))
            result.append(d)
        return result

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _make_output(self, parent: _ParentState) -> RequestOutput:
        delta = parent.kind == RequestOutputKind.DELTA
        completions = []
        for s in parent.samples:
            nothing_new = s.num_sent_tokens == len(s.token_ids)
            if delta and nothing_new and (s.finish_reason is None or s.finish_sent):
                continue
            text = ""
            if s.detokenizer is not None:
                text = (s.detokenizer.get_delta(s.finish_reason is not None) if delta
                        else s.detokenizer.text)
            start = s.num_sent_tokens if delta else 0
            completions.append(CompletionOutput(
                index=s.index,
                text=text,
                token_ids=s.token_ids[start:],
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.logprobs[start:] if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            ))
            s.num_sent_tokens = len(s.token_ids)
            s.finish_sent = s.finish_reason is not None
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
            kv_transfer_params=parent.kv_transfer_params,
            metrics={
                "arrival_time": parent.arrival_time,
                "first_token_time": parent.first_token_time,
                "prev_token_time": parent.prev_token_time,
                "last_token_time": parent.last_token_time,
            },
        )
