"""OpenAI-compatible request and response shapes (pydantic v2), with the sampling extras vLLM
users send through ``extra_body`` (``top_k``, ``min_p``, ``ignore_eos``, ``min_tokens``, ...).

Requests check types and shapes only; value ranges are checked once, by ``SamplingParams``,
whose ValueError messages name the parameter. A field that would change the answer but is not
supported is a 400 naming it (``request_fields``); other unknown fields are ignored, as
OpenAI-compatible servers commonly do, so clients that send newer options keep working.
"""

from __future__ import annotations

import time
from itertools import chain
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidatorFunctionWrapHandler,
    WrapValidator, field_validator, model_validator,
)

from widellm.entrypoints.input_checks import check_json_values
from widellm.entrypoints.protocol_structured import StructuredOutputFields
from widellm.entrypoints.request_fields import check_completion_request
from widellm.outputs import PromptLogprobs
from widellm.sampling_params import SamplingParams

# The default of --max-logprobs (vLLM's, and OpenAI's limit for chat ``top_logprobs``): the
# most top-N logprobs a request may ask for, per sampled or prompt token, so that no request
# asks for a top-k over the whole vocabulary.
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
    "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids",
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


class SamplingRequest(RequestModel, StructuredOutputFields):
    """Fields completions and chat share. ``None`` means "the SamplingParams default"."""

    model: str | None = None
    n: int = 1
    # OpenAI's: token id (a JSON object key) -> bias in [-100, 100] added to its logit.
    logit_bias: dict[str, float] | None = None
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
    # vLLM's field: only these tokens may be sampled.
    allowed_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    # vLLM's field: the top-N logprobs of every prompt token (the first, which nothing
    # predicts, has none), returned as ``prompt_logprobs``.
    prompt_logprobs: int | None = None
    # vLLM's field: requests with different salts never share prefix-cache blocks (tenant
    # isolation); the same salt shares; none shares with every other unsalted request.
    cache_salt: StrictStr | None = None
    # vLLM's field for disaggregated prefill/decode (see widellm/kv_transfer): what the
    # proxy tells a prefill instance ({"do_remote_decode": true}) or hands a decode instance
    # (the prefill's answer).
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's field: the prompt's token ids and each choice's generated ones in the response
    # (streamed: the prompt's on a choice's first chunk, each chunk's new ids on it).
    return_token_ids: bool | None = None
    # vLLM's field (and --return-tokens-as-token-ids): logprobs name each token
    # "token_id:{id}", for tokens whose text does not identify them (byte pieces, merges that
    # decode alike).
    return_tokens_as_token_ids: bool | None = None
    # vLLM's field: keep only the prompt's last this many tokens (-1: max_model_len).
    truncate_prompt_tokens: int | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_some(cls, keep: int | None) -> int | None:
        if keep is not None and keep < 1 and keep != -1:
            raise ValueError(f"must be -1 (max_model_len) or at least 1, got {keep}")
        return keep

    @field_validator("cache_salt")
    @classmethod
    def _non_empty_salt(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:
            raise ValueError("must be a non-empty string if given")
        return salt

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _check_prompt_logprobs(self, max_logprobs: int) -> None:
        if self.prompt_logprobs is None:
            return
        if self.stream:  # as vLLM: a stream has no place for them
            raise ValueError("prompt_logprobs: not available with stream=true")
        check_max_logprobs("prompt_logprobs", self.prompt_logprobs, max_logprobs)

    def _sampling_params(self, default_sampling_params: Mapping[str, Any] | None = None,
                         **extra: Any) -> SamplingParams:
        """Raises ValueError naming the parameter for out-of-range values. Fields the request
        leaves unset take ``default_sampling_params`` (the model's generation config) first,
        then SamplingParams' defaults; ``max_tokens`` comes in ``extra``."""
        kwargs = {k: getattr(self, k) for k in SAMPLING_FIELDS}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        for name, value in (default_sampling_params or {}).items():
            if name in SAMPLING_FIELDS:
                kwargs.setdefault(name, value)
        if self.kv_transfer_params is not None:
            extra["extra_args"] = {"kv_transfer_params": self.kv_transfer_params}
        extra.setdefault("structured_outputs", self.structured_outputs_params())
        return SamplingParams(**kwargs, **extra, logit_bias=self._logit_bias_ids())

    def _logit_bias_ids(self) -> dict[int, float] | None:
        """OpenAI's logit_bias maps token ids, written as JSON object keys, to biases."""
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            bad = next(t for t in self.logit_bias if not t.strip().lstrip("-").isdigit())
            raise ValueError(f"logit_bias: keys must be token ids, got {bad!r}") from None


def check_max_logprobs(name: str, value: int | None, max_logprobs: int) -> None:
    """The server-wide cap (--max-logprobs) on one top-N logprobs field."""
    if value is not None and value > max_logprobs:
        raise ValueError(f"{name} must be <= {max_logprobs}, got {value}")


class CompletionRequest(SamplingRequest):
    prompt: CompletionPrompt
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    # vLLM's field and default: a text prompt gets the tokenizer's special tokens (a BOS);
    # false for text that already has them (a chat rendered by the client).
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _no_silent_ignores(cls, data: Any) -> Any:
        check_completion_request(data)
        return data

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

    def _max_tokens(self, default_sampling_params: Mapping[str, Any]) -> int | None:
        """The request's max_tokens; unset or null: the generation config's, else OpenAI's
        default when unset and "until the context is full" when null."""
        sent = "max_tokens" in self.model_fields_set
        if sent and self.max_tokens is not None:
            return self.max_tokens
        if "max_tokens" in default_sampling_params:
            return default_sampling_params["max_tokens"]
        return None if sent else DEFAULT_COMPLETION_MAX_TOKENS

    def to_sampling_params(self, max_logprobs: int = MAX_LOGPROBS,
                           default_sampling_params: Mapping[str, Any] | None = None
                           ) -> SamplingParams:
        defaults = default_sampling_params or {}
        check_max_logprobs("logprobs", self.logprobs, max_logprobs)
        self._check_prompt_logprobs(max_logprobs)
        max_tokens = self._max_tokens(defaults)
        if max_tokens == 0 and not self.echo:  # with echo, 0 returns the prompt only
            raise ValueError("max_tokens must be >= 1, got 0")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            # Echo with logprobs returns the prompt's logprobs too, in the same top-N format.
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        if max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0  # the engine computes a prompt only for its logprobs
        return self._sampling_params(defaults, max_tokens=max_tokens, logprobs=self.logprobs,
                                     prompt_logprobs=prompt_logprobs)


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: TokenIds


# ---- responses -----------------------------------------------------------------------------

class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class PromptLogprob(OpenAIBaseModel):
    """One token's entry in ``prompt_logprobs`` (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (None for the first): token id -> its entry, the prompt's token and the
# top-N; JSON writes the ids as string keys, as vLLM's response does.
PromptLogprobsResponse = list[dict[int, PromptLogprob] | None]


def prompt_logprobs_response(token_ids: list[int], logprobs: PromptLogprobs,
                             num_top: int) -> PromptLogprobsResponse:
    """The engine's prompt logprobs as returned: per position the prompt's token and the
    ``num_top`` likeliest (the engine may hold more when echo asked for a larger top-N)."""
    result: PromptLogprobsResponse = []
    for token_id, position in zip(token_ids, logprobs):
        if position is None:
            result.append(None)
            continue
        result.append({
            tid: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in position.items()
            if tid == token_id or (lp.rank is not None and lp.rank <= num_top)})
    return result


def token_id_label(token_id: int) -> str:
    """vLLM's name of a token in logprobs under return_tokens_as_token_ids."""
    return f"token_id:{token_id}"


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
    prompt_logprobs: PromptLogprobsResponse | None = None
    # return_token_ids (vLLM's): the prompt's ids, and the choice's generated ids.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


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
