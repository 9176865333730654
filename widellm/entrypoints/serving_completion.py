"""POST /v1/completions: one engine request per prompt, ``n`` choices each (choice index =
prompt index * n + sample index), streamed as SSE chunks or returned whole. ``echo`` with
``max_tokens: 0`` computes the prompt only: the answer is the prompt (with its logprobs)."""

from __future__ import annotations

import time
from http import HTTPStatus
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from widellm.entrypoints.errors import APIError
from widellm.entrypoints.protocol import (
    CompletionLogProbs, CompletionRequest, CompletionResponse, CompletionResponseChoice,
    CompletionStreamResponse, UsageInfo, prompt_logprobs_response, token_id_label,
)
from widellm.entrypoints.serving_base import OpenAIServing, random_uuid
from widellm.entrypoints.streaming import (
    client_closed_response, merge_async_iterators, run_unless_disconnected, sse_response,
)
from widellm.outputs import CompletionOutput, Logprob, RequestOutput
from widellm.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest,
                                raw_request: Request) -> Response:
        model = self.model_name(request.model)
        self.check_engine()
        self.check_n(request.n)
        rank = self.data_parallel_rank(raw_request)
        params = self.sampling_params(request)
        prompts = await self.tokenize_prompts(request.prompts(), "prompt",
                                              request.add_special_tokens,
                                              self.prompt_truncation(request))
        if request.kv_transfer_params is not None and len(prompts) > 1:
            raise APIError("kv_transfer_params: one prompt per request (each prompt's KV "
                           "moves on its own)", HTTPStatus.BAD_REQUEST, "kv_transfer_params")
        for _, ids in prompts:
            self.check_length(len(ids), params.max_tokens, "prompt")
        run = _CompletionRun(self, request, params, model, prompts, rank)
        if request.stream:
            return sse_response(run.stream())
        completed, response = await run_unless_disconnected(run.collect(), raw_request)
        if not completed:
            return client_closed_response()
        return JSONResponse(response.model_dump())


@dataclass
class _ChoiceState:
    """What one choice has produced so far."""

    started: bool = False  # echo goes before the first delta
    finished: bool = False
    num_tokens: int = 0
    text_offset: int = 0  # characters so far, for logprobs' text_offset


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob] | None], num_top: int,
    text_offset: int, decode, as_ids: bool = False,
) -> tuple[CompletionLogProbs, int]:
    """The legacy format for these positions: each token (its text, or ``token_id:{id}`` when
    ``as_ids``), its logprob, the ``num_top`` most likely tokens, and where the token starts in
    the choice's text; and the offset after the last. A ``None`` position (the first prompt
    token, which nothing predicts) has no logprob."""
    result = CompletionLogProbs()
    for token_id, position in zip(token_ids, logprobs):
        if position is None:
            text, logprob, top = decode(token_id), None, None
        else:
            entry = position[token_id]
            text = entry.decoded_token if entry.decoded_token is not None else decode(token_id)
            logprob = entry.logprob
            ranked = sorted(((tid, lp) for tid, lp in position.items()
                             if lp.rank is not None and lp.rank <= num_top),
                            key=lambda item: item[1].rank)
            top = {}
            for tid, lp in ranked:  # tokens that decode alike share a key: keep the likeliest
                top.setdefault(token_id_label(tid) if as_ids else lp.decoded_token or "",
                               lp.logprob)
        result.tokens.append(token_id_label(token_id) if as_ids else text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result, text_offset


class _CompletionRun:
    """One request's engine requests and the choices they feed."""

    def __init__(self, serving: OpenAIServingCompletion, request: CompletionRequest,
                 params: SamplingParams, model: str,
                 prompts: list[tuple[str | None, list[int]]],
                 data_parallel_rank: int | None) -> None:
        self.serving = serving
        self.data_parallel_rank = data_parallel_rank
        self.request = request
        self.params = params
        self.model = model
        self.prompts = prompts
        self.request_id = f"cmpl-{random_uuid()}"
        self.created = int(time.time())
        self.choices = [_ChoiceState() for _ in range(len(prompts) * params.n)]
        self.kv_transfer_params: dict | None = None
        self.as_ids = serving.tokens_as_ids(request)

    def _decode(self, token_id: int) -> str:
        return self.serving.tokenizer.decode([token_id])

    def _prompt_text(self, prompt_index: int) -> str:
        text, ids = self.prompts[prompt_index]
        return text if text is not None else self.serving.tokenizer.decode(ids)

    async def _deltas(self) -> AsyncIterator[CompletionResponseChoice]:
        engine = self.serving.engine
        generators = [
            engine.generate({"prompt": text, "prompt_token_ids": ids}, self.params,
                            f"{self.request_id}-{i}", self.data_parallel_rank,
                            cache_salt=self.request.cache_salt)
            for i, (text, ids) in enumerate(self.prompts)
        ]
        async with aclosing(merge_async_iterators(generators)) as merged:
            async for prompt_index, output in merged:
                self.kv_transfer_params = output.kv_transfer_params or self.kv_transfer_params
                for sample in output.outputs:
                    delta = self._delta(prompt_index, output, sample)
                    if delta is not None:
                        yield delta

    def _delta(self, prompt_index: int, output: RequestOutput,
               sample: CompletionOutput) -> CompletionResponseChoice | None:
        """The choice's new text (and logprobs); None when there is nothing to send."""
        index = prompt_index * self.params.n + sample.index
        state = self.choices[index]
        if state.finished:  # already closed; later outputs repeat only its finish reason
            return None
        state.num_tokens += len(sample.token_ids)
        text = sample.text
        logprobs = None
        prompt_logprobs = None
        want_logprobs = self.request.logprobs is not None
        if want_logprobs:
            logprobs = CompletionLogProbs()
        token_ids = list(sample.token_ids) if self.request.return_token_ids else None
        prompt_token_ids = None
        if not state.started:
            state.started = True
            if self.request.return_token_ids:
                prompt_token_ids = list(output.prompt_token_ids)
            if self.request.prompt_logprobs is not None:  # complete once a sample has output
                prompt_logprobs = prompt_logprobs_response(
                    output.prompt_token_ids, output.prompt_logprobs or [],
                    self.request.prompt_logprobs)
            if self.request.echo:
                prompt_text = self._prompt_text(prompt_index)
                if want_logprobs:
                    ids = output.prompt_token_ids
                    logprobs, _ = completion_logprobs(
                        ids, output.prompt_logprobs or [None] * len(ids),
                        self.request.logprobs, state.text_offset, self._decode, self.as_ids)
                    # Offsets follow the echoed text, not the concatenated token strings.
                    state.text_offset = len(prompt_text)
                text = prompt_text + text
        if want_logprobs:
            new, state.text_offset = completion_logprobs(
                sample.token_ids, sample.logprobs or [], self.request.logprobs,
                state.text_offset, self._decode, self.as_ids)
            for name in CompletionLogProbs.model_fields:
                getattr(logprobs, name).extend(getattr(new, name))
        state.finished = sample.finish_reason is not None
        # Text can lag its tokens (a stop string's prefix, a character's first bytes); a delta
        # with no text still carries the choice's first-chunk fields and its new ids.
        if not (text or state.finished or (logprobs and logprobs.tokens) or token_ids
                or prompt_token_ids is not None or prompt_logprobs is not None):
            return None
        return CompletionResponseChoice(index=index, text=text, logprobs=logprobs,
                                        finish_reason=sample.finish_reason,
                                        stop_reason=sample.stop_reason,
                                        prompt_logprobs=prompt_logprobs,
                                        prompt_token_ids=prompt_token_ids, token_ids=token_ids)

    def usage(self) -> UsageInfo:
        prompt_tokens = sum(len(ids) for _, ids in self.prompts)
        completion_tokens = sum(c.num_tokens for c in self.choices)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)

    async def stream(self) -> AsyncIterator[CompletionStreamResponse]:
        async with aclosing(self._deltas()) as deltas:
            async for choice in deltas:
                yield CompletionStreamResponse(id=self.request_id, created=self.created,
                                               model=self.model, choices=[choice])
        if self.request.include_usage:
            yield CompletionStreamResponse(id=self.request_id, created=self.created,
                                           model=self.model, choices=[], usage=self.usage())

    async def collect(self) -> CompletionResponse:
        merged: dict[int, CompletionResponseChoice] = {}
        async with aclosing(self._deltas()) as deltas:
            async for delta in deltas:
                whole = merged.get(delta.index)
                if whole is None:
                    merged[delta.index] = delta
                    continue
                whole.text += delta.text
                whole.finish_reason, whole.stop_reason = delta.finish_reason, delta.stop_reason
                if whole.token_ids is not None and delta.token_ids is not None:
                    whole.token_ids.extend(delta.token_ids)
                if whole.logprobs is not None and delta.logprobs is not None:
                    for name in CompletionLogProbs.model_fields:
                        getattr(whole.logprobs, name).extend(getattr(delta.logprobs, name))
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=[merged[i] for i in sorted(merged)],
                                  usage=self.usage(),
                                  kv_transfer_params=self.kv_transfer_params)
