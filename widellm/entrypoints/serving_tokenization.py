"""POST /tokenize and /detokenize: the server's tokenizer (and chat template) as a service,
so clients can count tokens exactly as the engine will; GET /tokenizer_info (vLLM's, behind
--enable-tokenizer-info-endpoint) describes the tokenizer, so a client such as
lm-evaluation-harness's remote tokenizer needs no copy of it: it reads the special tokens and
the chat template there and tokenizes through /tokenize and /detokenize."""

from __future__ import annotations

import functools
import json
from http import HTTPStatus
from typing import Any

from transformers import AddedToken

from widellm.entrypoints.errors import APIError
from widellm.entrypoints.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeResponse
from widellm.entrypoints.protocol_chat import TokenizeRequest
from widellm.entrypoints.serving_base import OpenAIServing

# tokenizer_config.json keys that say where and how this server loaded the tokenizer (local
# paths among them), nothing about how it tokenizes.
LOAD_KEYS = frozenset({"name_or_path", "is_local", "local_files_only", "vocab_file",
                       "merges_file", "tokenizer_file", "cache_dir", "backend"})


def _json_value(value: Any) -> tuple[bool, Any]:
    """(whether it has a JSON form, that form): special tokens as their text."""
    if isinstance(value, AddedToken):
        return True, value.content
    if isinstance(value, dict):
        items = {str(k): _json_value(v) for k, v in value.items()}
        return True, {k: v for k, (ok, v) in items.items() if ok}
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False, None
    return True, value


class OpenAIServingTokenization(OpenAIServing):
    """Both run in the executor. Text that cannot fit in max_model_len is refused rather than
    counted: no request may make the server tokenize without bound."""

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.model_name(request.model)
        if request.messages is not None:
            ids = await self.chat_prompt_ids(request, validate=False)
        else:
            self.check_text_length(request.prompt, "prompt")
            encoded = await self.run_blocking(
                functools.partial(self.tokenizer, add_special_tokens=request.add_special_tokens),
                request.prompt)
            ids = list(encoded.input_ids)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.model_name(request.model)
        return DetokenizeResponse(prompt=await self.run_blocking(self._decode, request.tokens))

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's configuration (what tokenizer_config.json holds) with its class, its
        special tokens as text, the chat template this server renders (--chat-template when
        given) and the server's max_model_len."""
        tokenizer = self.tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
        for key, value in tokenizer.init_kwargs.items():
            ok, converted = _json_value(value)
            if ok and key not in LOAD_KEYS:
                info[key] = converted
        info.update(tokenizer.special_tokens_map)  # as loaded, whatever the config said
        info["chat_template"] = self.chat_template or getattr(tokenizer, "chat_template", None)
        info["max_model_len"] = self.max_model_len
        return info

    def _decode(self, tokens: list[int]) -> str:
        vocab_size = self.engine.processor.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(f"tokens: {bad[:3]} outside the vocabulary [0, {vocab_size})",
                           HTTPStatus.BAD_REQUEST, "tokens")
        return self.tokenizer.decode(tokens)
