"""What the OpenAI endpoints share: the served model names, checks that refuse a bad request
with a 4xx before anything reaches the engine, and turning prompts and chat messages into
token ids."""

from __future__ import annotations

import uuid
from http import HTTPStatus
from typing import Any

from jinja2 import TemplateError

from widellm.engine.async_llm import AsyncLLM
from widellm.entrypoints.errors import APIError
from widellm.entrypoints.protocol import ChatMessage
from widellm.sampling_params import SamplingParams


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], max_n: int) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.max_n = max_n
        self.max_model_len = engine.model_config.max_model_len
        self.tokenizer = engine.tokenizer

    # ---- checks (each raises APIError) ---------------------------------------------------

    def model_name(self, requested: str | None) -> str:
        """The served name a request addresses (the first one when it names none)."""
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise APIError(
                f"The model `{requested}` does not exist; this server serves "
                f"{', '.join(self.served_model_names)}", HTTPStatus.NOT_FOUND, "model")
        return requested

    def check_engine(self) -> None:
        if self.engine.errored:
            reason = self.engine.dead_error or "engine core process is not running"
            raise APIError(f"the engine is dead: {reason}", HTTPStatus.INTERNAL_SERVER_ERROR)

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise APIError(f"n must be <= {self.max_n} (the server's --max-n), got {n}",
                           HTTPStatus.BAD_REQUEST, "n")

    def sampling_params(self, request: Any) -> SamplingParams:
        try:
            return request.to_sampling_params()
        except ValueError as e:
            raise APIError.from_value_error(e) from None

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None,
                     prompt_param: str, max_tokens_param: str = "max_tokens") -> None:
        """The prompt and everything it may generate must fit in max_model_len."""
        limit = self.max_model_len
        if max_tokens is None:  # generate until the context is full: needs room for one
            if num_prompt_tokens >= limit:
                raise APIError(
                    f"{prompt_param}: {num_prompt_tokens} tokens leave no room to generate "
                    f"within max_model_len={limit}", HTTPStatus.BAD_REQUEST, prompt_param)
            return
        if num_prompt_tokens + max_tokens > limit:
            raise APIError(
                f"{max_tokens_param}: the prompt ({num_prompt_tokens} tokens) plus "
                f"{max_tokens_param} ({max_tokens}) is {num_prompt_tokens + max_tokens} tokens, "
                f"more than max_model_len={limit}; shorten the prompt or lower "
                f"{max_tokens_param}", HTTPStatus.BAD_REQUEST, max_tokens_param)

    # ---- prompts ---------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int],
                        param: str | None = None) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a valid prompt: in vocabulary, within the context."""
        processor = self.engine.processor
        try:
            text, ids = processor.tokenize(prompt)
            processor.validate_prompt(ids)
        except ValueError as e:
            raise APIError.from_value_error(e, param) from None
        return text, ids

    def chat_token_ids(self, messages: list[ChatMessage], add_generation_prompt: bool,
                       chat_template_kwargs: dict[str, Any] | None) -> list[int]:
        """Messages rendered by the model's chat template, as token ids."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError("messages: this model has no chat template; use /v1/completions",
                           HTTPStatus.BAD_REQUEST, "messages")
        try:
            ids = self.tokenizer.apply_chat_template(
                [m.to_template_dict() for m in messages], tokenize=True,
                add_generation_prompt=add_generation_prompt, return_dict=False,
                **(chat_template_kwargs or {}),
            )
        except (TemplateError, ValueError, TypeError) as e:
            # Templates reject conversations they cannot render (e.g. roles out of order).
            raise APIError(f"messages: the chat template failed: {e}", HTTPStatus.BAD_REQUEST,
                           "messages") from None
        return list(ids)
