"""OpenAI-compatible chat request and response shapes (pydantic v2): messages, the chat
template fields shared with /tokenize, and the chat completion, chunk and logprob models.
Shared fields and the completions shapes live in ``protocol``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, StrictStr, model_serializer, model_validator

from widellm.entrypoints.protocol import (
    MAX_LOGPROBS, OpenAIBaseModel, PromptLogprobsResponse, RequestModel, SamplingRequest,
    UsageInfo, _now,
)
from widellm.entrypoints.protocol_tools import (
    ChatCompletionTool, DeltaToolCall, ToolCall, ToolChoice, check_tool_choice,
)
from widellm.entrypoints.request_fields import check_chat_request
from widellm.sampling_params import SamplingParams

ASSISTANT_ROLE = "assistant"


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, sent back
    tool_call_id: str | None = None  # a "tool" message: the call it answers

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content is one string, and tool call
        arguments are objects (Qwen's and Llama's templates write them with ``tojson``)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [call.to_template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatTemplateFields(RequestModel):
    """How chat messages become a prompt (shared by chat and /tokenize)."""

    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's field: a Jinja template used instead of the model's. A template is code, so the
    # server renders one only when started with --trust-request-chat-template.
    chat_template: StrictStr | None = None
    # vLLM's field: render the last message (the assistant's) open, without a generation
    # prompt, so the model continues its text ("prefill" the answer).
    continue_final_message: bool = False
    # The functions the model may call, for the template to describe to it.
    tools: list[ChatCompletionTool] | None = None
    # vLLM's field: documents for a RAG template (Command R's, Granite's), e.g. {"title",
    # "text"} each; handed to the template, which decides how to show them.
    documents: list[dict[str, str]] | None = None

    @model_validator(mode="after")
    def _one_way_to_end(self) -> ChatTemplateFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be true together with "
                             "add_generation_prompt (send add_generation_prompt: false)")
        return self


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # As vLLM: handed to the chat template (reasoning models' templates read it).
    reasoning_effort: StrictStr | None = None
    # None: "auto" where the server enables it (--enable-auto-tool-choice), else "none".
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's field and default: the template writes the prompt's special tokens; true adds
    # the tokenizer's (a BOS) on top.
    add_special_tokens: bool = False

    @model_validator(mode="before")
    @classmethod
    def _no_silent_ignores(cls, data: Any) -> Any:
        check_chat_request(data)
        return data

    @model_validator(mode="after")
    def _tool_choice_in_tools(self) -> ChatCompletionRequest:
        check_tool_choice(self.tools, self.tool_choice)
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        """OpenAI's newer name wins over the deprecated one."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def to_sampling_params(self, max_logprobs: int = MAX_LOGPROBS,
                           default_sampling_params: Mapping[str, Any] | None = None
                           ) -> SamplingParams:
        top = self.top_logprobs
        if top is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs=true")
        if top is not None and not 0 <= top <= max_logprobs:
            raise ValueError(f"top_logprobs must be in [0, {max_logprobs}], got {top}")
        self._check_prompt_logprobs(max_logprobs)
        logprobs = (top or 0) if self.logprobs else None
        defaults = default_sampling_params or {}
        max_tokens = self.effective_max_tokens
        if max_tokens is None:  # unset: the generation config's, else until the context is full
            max_tokens = defaults.get("max_tokens")
        try:
            return self._sampling_params(defaults, max_tokens=max_tokens, logprobs=logprobs,
                                         prompt_logprobs=self.prompt_logprobs)
        except ValueError as e:
            # Name the field the client actually sent.
            if self.max_completion_tokens is not None and str(e).startswith("max_tokens"):
                raise ValueError("max_completion_tokens" + str(e)[len("max_tokens"):]) from None
            raise


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self



# ---- responses -----------------------------------------------------------------------------

class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatCompletionMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_when_made(self, handler):
        # As OpenAI: tool_calls appear only when there are some; content stays (null then).
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids (vLLM's): the generated ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None
    # vLLM's field: the prompt's logprobs when the request asked for prompt_logprobs.
    prompt_logprobs: PromptLogprobsResponse | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids (vLLM's)
    # A prefill instance's answer for the decode instance (disaggregated prefill/decode).
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        # A delta lists only what it carries; the closing chunk's delta is {} as in OpenAI.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the ids new in this chunk


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on each choice's first chunk
