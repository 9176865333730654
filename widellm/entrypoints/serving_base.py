"""What the OpenAI endpoints share: the served model names, checks that refuse a bad request
with a 4xx before anything reaches the engine, and turning prompts and chat messages into
token ids.

Tokenizing and rendering chat templates run in the app's thread pool, never on the event
loop: a long prompt takes seconds to tokenize, and meanwhile /health and every running stream
must keep flowing. Text that cannot fit in max_model_len is refused before either, by its
length alone (``InputProcessor.check_text_length``).
"""

from __future__ import annotations

import asyncio
import functools
import os
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

from jinja2 import TemplateError
from starlette.requests import Request

from widellm.engine.async_llm import AsyncLLM
from widellm.entrypoints.errors import APIError
from widellm.entrypoints.protocol import MAX_LOGPROBS
from widellm.entrypoints.protocol_chat import ASSISTANT_ROLE, ChatMessage, ChatTemplateFields
from widellm.entrypoints.protocol_tools import ChatCompletionTool
from widellm.sampling_params import SamplingParams


# Threads an app tokenizes and renders chat templates on. HF tokenizers release the GIL while
# encoding, so this many prompts tokenize at once; more would only take cores from the engine.
MAX_TOKENIZER_THREADS = 4
# The header that pins a request to one data-parallel rank (vLLM's name), for routers that
# place requests themselves (prefix-aware, disaggregated) and for tests.
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"
# The role whose message continue_final_message continues.


def random_uuid() -> str:
    return uuid.uuid4().hex


def tokenizer_executor() -> ThreadPoolExecutor:
    """A pool for one app's endpoints to share (the app shuts it down)."""
    return ThreadPoolExecutor(max_workers=min(MAX_TOKENIZER_THREADS, os.cpu_count() or 1),
                              thread_name_prefix="widellm-tokenize")


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], max_n: int, *,
                 executor: Executor, trust_request_chat_template: bool = False,
                 max_logprobs: int = MAX_LOGPROBS,
                 default_sampling_params: Mapping[str, Any] | None = None,
                 chat_template: str | None = None,
                 return_tokens_as_token_ids: bool = False) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.max_n = max_n
        self.max_model_len = engine.model_config.max_model_len
        self.tokenizer = engine.tokenizer
        self.executor = executor  # the app's, shared by its endpoints
        self.trust_request_chat_template = trust_request_chat_template
        self.max_logprobs = max_logprobs  # --max-logprobs
        # The model's generation-config defaults for fields a request leaves unset.
        self.default_sampling_params = dict(default_sampling_params or {})
        self.chat_template = chat_template  # --chat-template: instead of the model's
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # the flag: every request

    def tokens_as_ids(self, request: Any) -> bool:
        """Whether ``request``'s logprobs name tokens "token_id:{id}" (it or the server asks)."""
        return bool(self.return_tokens_as_token_ids or request.return_tokens_as_token_ids)

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the executor, off the event loop; its exceptions propagate."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

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
        if self.engine.draining:  # a request on a connection kept alive past SIGTERM
            raise APIError("the server is shutting down; send the request elsewhere",
                           HTTPStatus.SERVICE_UNAVAILABLE)

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise APIError(f"n must be <= {self.max_n} (the server's --max-n), got {n}",
                           HTTPStatus.BAD_REQUEST, "n")

    def data_parallel_rank(self, raw_request: Request) -> int | None:
        """The rank the request's ``X-data-parallel-rank`` header pins it to (None: the
        balancer picks); a rank that is not an integer or does not exist is a 400."""
        value = raw_request.headers.get(DATA_PARALLEL_RANK_HEADER)
        if value is None:
            return None
        try:
            rank = int(value)
        except ValueError:
            raise APIError(f"{DATA_PARALLEL_RANK_HEADER}: must be an integer, got {value!r}",
                           HTTPStatus.BAD_REQUEST, DATA_PARALLEL_RANK_HEADER) from None
        try:
            self.engine.client.check_rank(rank)
        except ValueError as e:
            raise APIError(f"{DATA_PARALLEL_RANK_HEADER}: {e}", HTTPStatus.BAD_REQUEST,
                           DATA_PARALLEL_RANK_HEADER) from None
        return rank

    def sampling_params(self, request: Any) -> SamplingParams:
        try:
            params = request.to_sampling_params(self.max_logprobs,
                                                self.default_sampling_params)
            self.engine.processor.validate_params(params, request.structured_outputs_source())
        except ValueError as e:
            raise APIError.from_value_error(e) from None
        return params

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

    def check_text_length(self, text: str, param: str) -> None:
        try:
            self.engine.processor.check_text_length(text, param)
        except ValueError as e:
            raise APIError.from_value_error(e, param) from None

    def prompt_truncation(self, request: Any) -> int | None:
        """The prompt tokens ``request`` keeps (its last ones; vLLM's truncate_prompt_tokens,
        -1: max_model_len), None for all."""
        keep = request.truncate_prompt_tokens
        if keep == -1:
            return self.max_model_len
        if keep is not None and keep > self.max_model_len:
            raise APIError(f"truncate_prompt_tokens: {keep} is more than max_model_len="
                           f"{self.max_model_len}", HTTPStatus.BAD_REQUEST,
                           "truncate_prompt_tokens")
        return keep

    async def tokenize_prompts(self, prompts: list[str | list[int]], param: str,
                               add_special_tokens: bool = True, truncate: int | None = None
                               ) -> list[tuple[str | None, list[int]]]:
        """``tokenize_prompt`` of each, in the executor; text too long to fit is refused first,
        on the loop, so it never waits for (or holds) a worker (text to be truncated is
        bounded by the request body's size instead)."""
        for prompt in prompts:
            if isinstance(prompt, str) and truncate is None:
                self.check_text_length(prompt, param)
        return await self.run_blocking(
            lambda: [self.tokenize_prompt(p, param, add_special_tokens, truncate)
                     for p in prompts])

    def tokenize_prompt(self, prompt: str | list[int], param: str | None = None,
                        add_special_tokens: bool = True, truncate: int | None = None
                        ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a valid prompt: in vocabulary, within the context;
        ``truncate``: only its last that many tokens (then no text: it would not match)."""
        processor = self.engine.processor
        try:
            text, ids = processor.tokenize(prompt, add_special_tokens, truncate is None)
            if truncate is not None and len(ids) > truncate:
                text, ids = None, ids[-truncate:]
            processor.validate_prompt(ids)
        except ValueError as e:
            raise APIError.from_value_error(e, param) from None
        return text, ids

    def request_chat_template(self, request: ChatTemplateFields) -> str | None:
        """The template a request brings (top level or in ``chat_template_kwargs``), refused
        unless the server trusts request templates: one is code the server would run, and two
        nested loops in 174 bytes held the server for seconds."""
        in_kwargs = (request.chat_template_kwargs or {}).get("chat_template")
        given = {name: template for name, template in (
            ("chat_template", request.chat_template), ("chat_template_kwargs", in_kwargs))
            if template is not None}
        if not given:
            return None
        param = next(iter(given))
        where = param if param == "chat_template" else "chat_template_kwargs.chat_template"
        if not self.trust_request_chat_template:
            raise APIError(f"{where}: this server does not render chat templates sent in "
                           f"requests (start it with --trust-request-chat-template to allow "
                           f"them)", HTTPStatus.BAD_REQUEST, param)
        if not isinstance(in_kwargs, str | None):
            raise APIError("chat_template_kwargs: chat_template_kwargs.chat_template must be a "
                           "string", HTTPStatus.BAD_REQUEST, "chat_template_kwargs")
        if len(set(given.values())) > 1:
            raise APIError("chat_template: given at the top level and in chat_template_kwargs, "
                           "differently", HTTPStatus.BAD_REQUEST, "chat_template")
        return given[param]

    async def chat_prompt_ids(self, request: ChatTemplateFields, validate: bool,
                              add_special_tokens: bool = False,
                              truncate: int | None = None) -> list[int]:
        """A chat request's messages as token ids, rendered and tokenized in the executor;
        ``validate``: also checked as a prompt (in vocabulary, within max_model_len);
        ``add_special_tokens``: the tokenizer's (a BOS) on top of what the template wrote;
        ``truncate``: only the last that many tokens."""
        template = self.request_chat_template(request) or self.chat_template
        kwargs = {k: v for k, v in (request.chat_template_kwargs or {}).items()
                  if k != "chat_template"}
        reasoning_effort = getattr(request, "reasoning_effort", None)
        if reasoning_effort is not None:  # as vLLM: the template decides what it means
            kwargs.setdefault("reasoning_effort", reasoning_effort)
        if request.continue_final_message:
            self.check_continuable(request.messages)

        def render() -> list[int]:
            ids = self.chat_token_ids(request.messages, request.add_generation_prompt, kwargs,
                                      template, request.continue_final_message, request.tools,
                                      add_special_tokens, check_length=truncate is None,
                                      documents=request.documents)
            if truncate is not None:  # at least 1 (the request's field is checked)
                ids = ids[-truncate:]
            return self.tokenize_prompt(ids, "messages")[1] if validate else ids

        return await self.run_blocking(render)

    @staticmethod
    def check_continuable(messages: list[ChatMessage]) -> None:
        """continue_final_message continues an answer: the last message must be one."""
        if not messages:
            raise APIError("continue_final_message: there is no message to continue",
                           HTTPStatus.BAD_REQUEST, "continue_final_message")
        role = messages[-1].role
        if role != ASSISTANT_ROLE:
            raise APIError(f"continue_final_message: the last message must be the "
                           f"{ASSISTANT_ROLE}'s, got role {role!r}", HTTPStatus.BAD_REQUEST,
                           "continue_final_message")

    def chat_token_ids(self, messages: list[ChatMessage], add_generation_prompt: bool,
                       chat_template_kwargs: dict[str, Any] | None,
                       chat_template: str | None = None,
                       continue_final_message: bool = False,
                       tools: list[ChatCompletionTool] | None = None,
                       add_special_tokens: bool = False,
                       check_length: bool = True,
                       documents: list[dict[str, str]] | None = None) -> list[int]:
        """Messages rendered by ``chat_template`` (default: the model's), as token ids; with
        ``continue_final_message`` the last message is left open (no end-of-turn), so the
        model goes on with its text. The rendered text is checked for length before it is
        tokenized."""
        if self.tokenizer is None or not (
                chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise APIError("messages: this model has no chat template; use /v1/completions",
                           HTTPStatus.BAD_REQUEST, "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                [m.to_template_dict() for m in messages], chat_template=chat_template,
                tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
                documents=documents,
                **(chat_template_kwargs or {}),
            )
        except (TemplateError, ValueError, TypeError) as e:
            # Templates reject conversations they cannot render (e.g. roles out of order).
            raise APIError(f"messages: the chat template failed: {e}", HTTPStatus.BAD_REQUEST,
                           "messages") from None
        if check_length:
            self.check_text_length(text, "messages")
        # By default as apply_chat_template(tokenize=True) does: the template wrote the
        # special tokens.
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
