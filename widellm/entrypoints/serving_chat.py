"""POST /v1/chat/completions: the messages go through the model's chat template, then one
engine request with ``n`` samples. Streaming sends, per choice, a first chunk with
``{"role": "assistant"}``, content deltas, and a closing chunk with the finish reason. With
tools, outputs become ``tool_calls`` (and tool-call deltas) as ``tool_calls.py`` says."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from widellm.entrypoints.errors import APIError
from widellm.entrypoints.protocol import (
    PromptLogprobsResponse, UsageInfo, prompt_logprobs_response, token_id_label,
)
from widellm.entrypoints.protocol_chat import (
    ASSISTANT_ROLE,
    ChatCompletionLogProbs, ChatCompletionMessage, ChatCompletionRequest,
    ChatCompletionResponse, ChatCompletionResponseChoice, ChatCompletionStreamChoice,
    ChatCompletionStreamResponse, ChatLogProb, ChatLogProbsContent, DeltaMessage,
)
from widellm.entrypoints.serving_base import OpenAIServing, random_uuid
from widellm.entrypoints.tool_calls import ToolCallPlan, ToolCallStream, tool_finish_reason
from widellm.entrypoints.tool_parsers import TOOL_PARSERS
from widellm.entrypoints.streaming import (
    client_closed_response, run_unless_disconnected, sse_response,
)
from widellm.outputs import CompletionOutput, Logprob
from widellm.sampling_params import SamplingParams



class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_parser = TOOL_PARSERS[tool_call_parser] if tool_call_parser else None

    def tool_plan(self, request: ChatCompletionRequest,
                  params: SamplingParams) -> ToolCallPlan | None:
        """How the request's outputs become tool calls (None: they do not); sets the schema
        of a required or named tool_choice on ``params`` and checks it like a request's own."""
        plan = ToolCallPlan.for_request(request, self.enable_auto_tool_choice, self.tool_parser)
        if plan is not None and plan.constrains:
            plan.constrain(params)
            try:
                self.engine.processor.validate_params(params, "tools")
            except ValueError as e:
                raise APIError.from_value_error(e, "tools") from None
        return plan

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        model = self.model_name(request.model)
        self.check_engine()
        self.check_n(request.n)
        rank = self.data_parallel_rank(raw_request)
        params = self.sampling_params(request)
        tools = self.tool_plan(request, params)
        ids = await self.chat_prompt_ids(request, validate=True,
                                         add_special_tokens=request.add_special_tokens,
                                         truncate=self.prompt_truncation(request))
        self.check_length(len(ids), params.max_tokens, "messages",
                          "max_completion_tokens" if request.max_completion_tokens is not None
                          else "max_tokens")
        run = _ChatRun(self, request, params, model, ids, rank, tools)
        if request.stream:
            return sse_response(run.stream())
        completed, response = await run_unless_disconnected(run.collect(), raw_request)
        if not completed:
            return client_closed_response()
        return JSONResponse(response.model_dump())


def _logprob_entry(token_id: int, lp: Logprob, as_ids: bool) -> ChatLogProb:
    text = lp.decoded_token or ""
    # ``bytes`` stay the text's: what the token writes, whatever names it.
    return ChatLogProb(token=token_id_label(token_id) if as_ids else text, logprob=lp.logprob,
                       bytes=list(text.encode("utf-8")))


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int, as_ids: bool = False) -> ChatCompletionLogProbs:
    """Per generated token: its logprob and the ``num_top`` most likely alternatives, each
    named by its text or (``as_ids``) ``token_id:{id}``."""
    content = []
    for token_id, position in zip(token_ids, logprobs):
        ranked = sorted(((tid, lp) for tid, lp in position.items()
                         if lp.rank is not None and lp.rank <= num_top),
                        key=lambda item: item[1].rank)
        entry = _logprob_entry(token_id, position[token_id], as_ids)
        content.append(ChatLogProbsContent(
            **entry.model_dump(),
            top_logprobs=[_logprob_entry(tid, lp, as_ids) for tid, lp in ranked]))
    return ChatCompletionLogProbs(content=content)


class _ChatRun:
    """One chat request: its engine request and the ``n`` choices it feeds."""

    def __init__(self, serving: OpenAIServingChat, request: ChatCompletionRequest,
                 params: SamplingParams, model: str, prompt_ids: list[int],
                 data_parallel_rank: int | None, tools: ToolCallPlan | None = None) -> None:
        self.serving = serving
        self.tools = tools
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
        self.prompt_logprobs: PromptLogprobsResponse | None = None

    async def _samples(self) -> AsyncIterator[CompletionOutput]:
        """New output of each choice, once per choice after it finished."""
        gen = self.serving.engine.generate({"prompt_token_ids": self.prompt_ids}, self.params,
                                           self.request_id, self.data_parallel_rank,
                                           cache_salt=self.request.cache_salt)
        async with aclosing(gen):
            async for output in gen:
                self.kv_transfer_params = output.kv_transfer_params or self.kv_transfer_params
                if self.request.prompt_logprobs is not None and output.finished:
                    self.prompt_logprobs = prompt_logprobs_response(
                        self.prompt_ids, output.prompt_logprobs or [],
                        self.request.prompt_logprobs)
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
                             self.request.top_logprobs or 0,
                             self.serving.tokens_as_ids(self.request))

    def usage(self) -> UsageInfo:
        completion_tokens = sum(self.num_tokens)
        return UsageInfo(prompt_tokens=len(self.prompt_ids), completion_tokens=completion_tokens,
                         total_tokens=len(self.prompt_ids) + completion_tokens)

    def _chunk(self, choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None,
               prompt_token_ids: list[int] | None = None) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, created=self.created,
                                            model=self.model, choices=choices, usage=usage,
                                            prompt_token_ids=prompt_token_ids)

    def _token_ids(self, sample: CompletionOutput) -> list[int] | None:
        return list(sample.token_ids) if self.request.return_token_ids else None

    @staticmethod
    def _deltas(sample: CompletionOutput,
                tool_streams: list[ToolCallStream] | None) -> list[DeltaMessage]:
        """What a choice's new output sends: its text, or what its tool-call stream makes of
        it."""
        if tool_streams is None:
            return [DeltaMessage(content=sample.text)] if sample.text else []
        stream = tool_streams[sample.index]
        deltas = stream.feed(sample.text)
        if sample.finish_reason is not None:
            deltas += stream.finish()
        return deltas

    async def stream(self) -> AsyncIterator[ChatCompletionStreamResponse]:
        prompt_ids = self.prompt_ids if self.request.return_token_ids else None
        for i in range(self.params.n):
            yield self._chunk([ChatCompletionStreamChoice(
                index=i, delta=DeltaMessage(role=ASSISTANT_ROLE, content=""))],
                prompt_token_ids=prompt_ids)
        tool_streams = ([self.tools.stream() for _ in range(self.params.n)]
                        if self.tools else None)
        async with aclosing(self._samples()) as samples:
            async for sample in samples:
                logprobs = self._logprobs(sample)
                token_ids = self._token_ids(sample)
                deltas = self._deltas(sample, tool_streams)
                if not deltas and ((logprobs is not None and logprobs.content) or token_ids):
                    deltas = [DeltaMessage(content="")]  # the logprobs and ids still go out
                for k, delta in enumerate(deltas):  # logprobs and ids ride on the first
                    yield self._chunk([ChatCompletionStreamChoice(
                        index=sample.index, delta=delta, logprobs=None if k else logprobs,
                        token_ids=None if k else token_ids)])
                if sample.finish_reason is not None:
                    made_calls = bool(tool_streams) and tool_streams[sample.index].made_calls
                    yield self._chunk([ChatCompletionStreamChoice(
                        index=sample.index, delta=DeltaMessage(),
                        finish_reason=tool_finish_reason(sample.finish_reason, made_calls),
                        stop_reason=sample.stop_reason)])
        if self.request.include_usage:
            yield self._chunk([], self.usage())

    async def collect(self) -> ChatCompletionResponse:
        texts: list[list[str]] = [[] for _ in range(self.params.n)]
        token_ids = [[] if self.request.return_token_ids else None
                     for _ in range(self.params.n)]
        logprobs = [self._logprobs(CompletionOutput(i, "", [])) for i in range(self.params.n)]
        reasons: list[tuple[str | None, int | str | None]] = [(None, None)] * self.params.n
        async with aclosing(self._samples()) as samples:
            async for sample in samples:
                texts[sample.index].append(sample.text)
                if token_ids[sample.index] is not None:
                    token_ids[sample.index].extend(sample.token_ids)
                new = self._logprobs(sample)
                if new is not None:
                    logprobs[sample.index].content.extend(new.content)
                reasons[sample.index] = (sample.finish_reason, sample.stop_reason)
        messages = [self.tools.message("".join(t)) if self.tools else
                    ChatCompletionMessage(role=ASSISTANT_ROLE, content="".join(t)) for t in texts]
        choices = [
            ChatCompletionResponseChoice(
                index=i, message=messages[i], logprobs=logprobs[i],
                finish_reason=tool_finish_reason(reasons[i][0], bool(messages[i].tool_calls)),
                stop_reason=reasons[i][1], token_ids=token_ids[i])
            for i in range(self.params.n)
        ]
        return ChatCompletionResponse(id=self.request_id, created=self.created,
                                      model=self.model, choices=choices, usage=self.usage(),
                                      prompt_logprobs=self.prompt_logprobs,
                                      prompt_token_ids=(self.prompt_ids if
                                                        self.request.return_token_ids else None),
                                      kv_transfer_params=self.kv_transfer_params)
