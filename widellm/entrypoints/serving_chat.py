"""POST /v1/chat/completions: the messages go through the model's chat template, then one
engine request with ``n`` samples. Streaming sends, per choice, a first chunk with
``{"role": "assistant"}``, content deltas, and a closing chunk with the finish reason."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from widellm.entrypoints.protocol import UsageInfo
from widellm.entrypoints.protocol_chat import (
    ChatCompletionLogProbs, ChatCompletionMessage, ChatCompletionRequest,
    ChatCompletionResponse, ChatCompletionResponseChoice, ChatCompletionStreamChoice,
    ChatCompletionStreamResponse, ChatLogProb, ChatLogProbsContent, DeltaMessage,
)
from widellm.entrypoints.serving_base import OpenAIServing, random_uuid
from widellm.entrypoints.streaming import (
    client_closed_response, run_unless_disconnected, sse_response,
)
from widellm.outputs import CompletionOutput, Logprob
from widellm.sampling_params import SamplingParams

ASSISTANT_ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        model = self.model_name(request.model)
        self.check_engine()
        self.check_n(request.n)
        rank = self.data_parallel_rank(raw_request)
        params = self.sampling_params(request)
        ids = await self.chat_prompt_ids(request, validate=True)
        self.check_length(len(ids), params.max_tokens, "messages",
                          "max_completion_tokens" if request.max_completion_tokens is not None
                          else "max_tokens")
        run = _ChatRun(self, request, params, model, ids, rank)
        if request.stream:
            return sse_response(run.stream())
        completed, response = await run_unless_disconnected(run.collect(), raw_request)
        if not completed:
            return client_closed_response()
        return JSONResponse(response.model_dump())


def _logprob_entry(lp: Logprob) -> ChatLogProb:
    token = lp.decoded_token or ""
    return ChatLogProb(token=token, logprob=lp.logprob, bytes=list(token.encode("utf-8")))


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int) -> ChatCompletionLogProbs:
    """Per generated token: its logprob and the ``num_top`` most likely alternatives."""
    content = []
    for token_id, position in zip(token_ids, logprobs):
        ranked = sorted((lp for lp in position.values()
                         if lp.rank is not None and lp.rank <= num_top), key=lambda lp: lp.rank)
        entry = _logprob_entry(position[token_id])
        content.append(ChatLogProbsContent(
            **entry.model_dump(), top_logprobs=[_logprob_entry(lp) for lp in ranked]))
    return ChatCompletionLogProbs(content=content)


class _ChatRun:
    """One chat request: its engine request and the ``n`` choices it feeds."""

    def __init__(self, serving: OpenAIServingChat, request: ChatCompletionRequest,
                 params: SamplingParams, model: str, prompt_ids: list[int],
                 data_parallel_rank: int | None) -> None:
        self.serving = serving
        self.data_parallel_rank = data_parallel_rank
        self.request = request
        self.params = params
        self.model = model
        self.prompt_ids = prompt_ids
        self.request_id = f"chatcmpl-{random_uuid()}"
        self.created = int(time.time())
        self.num_tokens = [0] * params.n
        self.finished = [False] * params.n
        self.kv_transfer_params: dict | None = None

    async def _samples(self) -> AsyncIterator[CompletionOutput]:
        """New output of each choice, once per choice after it finished."""
        gen = self.serving.engine.generate({"prompt_token_ids": self.prompt_ids}, self.params,
                                           self.request_id, self.data_parallel_rank,
                                           cache_salt=self.request.cache_salt)
        async with aclosing(gen):
            async for output in gen:
                self.kv_transfer_params = output.kv_transfer_params or self.kv_transfer_params
                for sample in output.outputs:
                    if self.finished[sample.index]:  # later outputs repeat its finish reason
                        continue
                    self.num_tokens[sample.index] += len(sample.token_ids)
                    self.finished[sample.index] = sample.finish_reason is not None
                    yield sample

    def _logprobs(self, sample: CompletionOutput) -> ChatCompletionLogProbs | None:
        if not self.request.logprobs:
            return None
        return chat_logprobs(sample.token_ids, sample.logprobs or [],
                             self.request.top_logprobs or 0)

    def usage(self) -> UsageInfo:
        completion_tokens = sum(self.num_tokens)
        return UsageInfo(prompt_tokens=len(self.prompt_ids), completion_tokens=completion_tokens,
                         total_tokens=len(self.prompt_ids) + completion_tokens)

    def _chunk(self, choices: list[ChatCompletionStreamChoice],
               usage: UsageInfo | None = None) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, created=self.created,
                                            model=self.model, choices=choices, usage=usage)

    async def stream(self) -> AsyncIterator[ChatCompletionStreamResponse]:
        for i in range(self.params.n):
            yield self._chunk([ChatCompletionStreamChoice(
                index=i, delta=DeltaMessage(role=ASSISTANT_ROLE, content=""))])
        async with aclosing(self._samples()) as samples:
            async for sample in samples:
                logprobs = self._logprobs(sample)
                if sample.text or (logprobs is not None and logprobs.content):
                    yield self._chunk([ChatCompletionStreamChoice(
                        index=sample.index, delta=DeltaMessage(content=sample.text),
                        logprobs=logprobs)])
                if sample.finish_reason is not None:
                    yield self._chunk([ChatCompletionStreamChoice(
                        index=sample.index, delta=DeltaMessage(),
                        finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)])
        if self.request.include_usage:
            yield self._chunk([], self.usage())

    async def collect(self) -> ChatCompletionResponse:
        texts: list[list[str]] = [[] for _ in range(self.params.n)]
        logprobs = [self._logprobs(CompletionOutput(i, "", [])) for i in range(self.params.n)]
        reasons: list[tuple[str | None, int | str | None]] = [(None, None)] * self.params.n
        async with aclosing(self._samples()) as samples:
            async for sample in samples:
                texts[sample.index].append(sample.text)
                new = self._logprobs(sample)
                if new is not None:
                    logprobs[sample.index].content.extend(new.content)
                reasons[sample.index] = (sample.finish_reason, sample.stop_reason)
        choices = [
            ChatCompletionResponseChoice(
                index=i, message=ChatCompletionMessage(role=ASSISTANT_ROLE,
                                                       content="".join(texts[i])),
                logprobs=logprobs[i], finish_reason=reasons[i][0], stop_reason=reasons[i][1])
            for i in range(self.params.n)
        ]
        return ChatCompletionResponse(id=self.request_id, created=self.created,
                                      model=self.model, choices=choices, usage=self.usage(),
                                      kv_transfer_params=self.kv_transfer_params)
