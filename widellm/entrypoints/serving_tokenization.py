"""POST /tokenize and /detokenize: the server's tokenizer (and chat template) as a service,
so clients can count tokens exactly as the engine will."""

from __future__ import annotations

from http import HTTPStatus

from widellm.entrypoints.errors import APIError
from widellm.entrypoints.protocol import (
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
)
from widellm.entrypoints.serving_base import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.model_name(request.model)
        if request.messages is not None:
            ids = self.chat_token_ids(request.messages, request.add_generation_prompt,
                                      request.chat_template_kwargs)
        else:
            ids = list(self.tokenizer(
                request.prompt, add_special_tokens=request.add_special_tokens).input_ids)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.model_name(request.model)
        vocab_size = self.engine.processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(f"tokens: {bad[:3]} outside the vocabulary [0, {vocab_size})",
                           HTTPStatus.BAD_REQUEST, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
