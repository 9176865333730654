"""Per-request sampling settings, with the field names and defaults vLLM users know."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass
from typing import Any

# A temperature below this is treated as greedy decoding: dividing logits by it would overflow
# and the result is argmax anyway.
SAMPLING_EPS = 1e-5

# OpenAI's documented range for presence and frequency penalties.
MAX_ABS_PENALTY = 2.0
# OpenAI's range for a logit_bias value: -100 bans a token, +100 all but forces it.
MAX_ABS_LOGIT_BIAS = 100.0


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's ``StructuredOutputsParams``):
    exactly one of ``json`` (a JSON schema, as a dict or its text), ``json_object`` (any JSON
    object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF, GBNF style).
    ``disable_any_whitespace``: JSON without free whitespace between tokens (compact output).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of json, regex, choice, "
                             f"grammar or json_object, got {given or 'none'}")
        if self.choice is not None and (
                not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty "
                             "strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next tokens of one request, and when to stop.

    ``top_k`` of 0 (or -1, normalised to 0) disables top-k; ``max_tokens=None`` means up to
    the model's context length. ``logprobs`` is the number of top logprobs returned per sampled
    token (the sampled token is always returned as well). End-of-sequence tokens are not part
    of these params: the request carries them, and ``ignore_eos`` says whether they stop it.
    ``max_tokens=0`` computes the prompt only (for ``prompt_logprobs``) and samples nothing.
    ``allowed_token_ids`` (vLLM's) bans every other token, first; ``logit_bias`` then adds a
    value in [-100, 100] to a token's logit, before anything else (the ids of both are
    checked against the vocabulary by the engine's input processor);
    ``structured_outputs`` constrains every sampled token to a grammar.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's free-form extras; "kv_transfer_params" is read by the KV connector
    # (disaggregated prefill/decode, see widellm/kv_transfer).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < SAMPLING_EPS:
            # Greedy decoding ignores the filters; clearing them keeps batches that mix greedy
            # and random rows from doing filter work for the greedy ones.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    def _verify(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if abs(self.presence_penalty) > MAX_ABS_PENALTY:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if abs(self.frequency_penalty) > MAX_ABS_PENALTY:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
            )
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            # (0 computes the prompt only: it needs prompt logprobs to return anything)
            raise ValueError("max_tokens must be >= 1, got 0")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        # bool is an int subclass, but seed=True is a mistake, not a seed.
        seed_is_int = isinstance(self.seed, int) and not isinstance(self.seed, bool)
        if self.seed is not None and not seed_is_int:
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must contain only non-empty strings, got {self.stop!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias: keys must be token ids >= 0, got {token!r}")
            if not abs(bias) <= MAX_ABS_LOGIT_BIAS:  # also refuses nan
                raise ValueError(f"logit_bias: values must be in [-100, 100], got {bias} for "
                                 f"token {token}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(t < 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids >= 0, "
                             f"got {self.allowed_token_ids}")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """Token ids that end the request, EOS excluded (the request carries that)."""
        return frozenset(self.stop_token_ids)

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
