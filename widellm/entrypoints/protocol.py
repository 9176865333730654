"""OpenAI-compatible request and response shapes (pydantic v2), with the sampling extras vLLM
users send through ``extra_body`` (``top_k``, ``min_p``, ``ignore_eos``, ``min_tokens``, ...).

Requests check types and shapes only; value ranges are checked once, by ``SamplingParams``,
whose ValueError messages name the parameter. Unknown fields are ignored, as OpenAI-compatible
servers commonly do, so clients that send newer options keep working.
"""

from __future__ import annotations

import time
from itertools import chain
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidatorFunctionWrapHandler,
    WrapValidator, field_validator, model_validator,
)

from widellm.entrypoints.input_checks import check_json_values
from widellm.sampling_params import SamplingParams

# OpenAI's limit for chat ``top_logprobs``; applied to completions' ``logprobs`` as well so a
# request cannot ask for a top-k over the whole vocabulary.
MAX_LOGPROBS = 20
# OpenAI's default for /v1/completions; chat defaults to "until the context is full".
DEFAULT_COMPLETION_MAX_TOKENS = 16

# Prompt shapes of /v1/completions. Strict types: "1" or true must not become token ids.
TokenIds = list[StrictInt]


def _is_flat(value: Any, kind: type) -> bool:
    return isinstance(value, list) and set(map(type, value)) == {kind}


def _prompt_by_shape(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A list of only ints or only strings (or lists of only ints) is already valid; the
    union's own validation tries every member on every element first, which took 0.4 s of
    event-loop time for a 4 MiB token-id prompt. Anything else goes through the union (and
    gets its errors). ``type`` is exact, so true and false never pass as token ids."""
    if _is_flat(value, int) or _is_flat(value, str):
        return value
    if _is_flat(value, list) and set(map(type, chain.from_iterable(value))) == {int}:
        return value
    return handler(value)


CompletionPrompt = Annotated[StrictStr | list[StrictStr] | TokenIds | list[TokenIds],
                             WrapValidator(_prompt_by_shape)]


# Request fields passed to SamplingParams unchanged (when not None).
SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
    "skip_special_tokens", "include_stop_str_in_output",
)


def _now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIBaseModel):
    """A request body: refuses NaN, Infinity, integers beyond 64 bits and lone surrogates
    anywhere in it, naming the field (``input_checks``)."""

    @model_validator(mode="before")
    @classmethod
    def _check_json_values(cls, data: Any) -> Any:
        check_json_values(data)
        return data


# ---- errors --------------------------------------------------------------------------------

class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- requests ------------------------------------------------------------------------------

class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(RequestModel):
    """Fields completions and chat share. ``None`` means "the SamplingParams default"."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    # vLLM's field: requests with different salts never share prefix-cache blocks (tenant
    # isolation); the same salt shares; none shares with every other unsalted request.
    cache_salt: StrictStr | None = None
    # vLLM's field for disaggregated prefill/decode (see widellm/kv_transfer): what the
    # proxy tells a prefill instance ({"do_remote_decode": true}) or hands a decode instance
    # (the prefill's answer).
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("cache_salt")
    @classmethod
    def _non_empty_salt(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:
            raise ValueError("must be a non-empty string if given")
        return salt

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, **extra: Any) -> SamplingParams:
        """Raises ValueError naming the parameter for out-of-range values."""
        kwargs = {k: getattr(self, k) for k in SAMPLING_FIELDS}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if self.kv_transfer_params is not None:
            extra["extra_args"] = {"kv_transfer_params": self.kv_transfer_params}
        return SamplingParams(**kwargs, **extra)


class CompletionRequest(SamplingRequest):
    prompt: CompletionPrompt
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False

    @model_validator(mode="after")
    def _non_empty_prompt(self) -> CompletionRequest:
        # A list prompt is one shape throughout (validated): all(...) checks, at C speed,
        # that no token-id list in a list of them is empty.
        if isinstance(self.prompt, list) and (
            not self.prompt or (isinstance(self.prompt[0], list) and not all(self.prompt))
        ):
            raise ValueError("prompt: must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs}")
        # Echo with logprobs returns the prompt's logprobs too, in the same top-N format.
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(max_tokens=self.max_tokens, logprobs=self.logprobs,
                                     prompt_logprobs=prompt_logprobs)


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: TokenIds


# ---- responses -----------------------------------------------------------------------------

class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(OpenAIBaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _CompletionBody(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class CompletionResponse(_CompletionBody):
    # A prefill instance's answer for the decode instance (disaggregated prefill/decode).
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(_CompletionBody):
    """One SSE chunk; ``usage`` is set only on the final usage chunk."""


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "widellm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str
