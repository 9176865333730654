"""POST /tokenize and /detokenize: the server's tokenizer (and chat template) as a service,
so clients can count tokens exactly as the engine will."""

from __future__ import annotations

import functools
from http import HTTPStatus

from widellm.entrypoints.errors import APIError
from widellm.entrypoints.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeResponse
from widellm.entrypoints.protocol_chat import TokenizeRequest
from widellm.entrypoints.serving_base import OpenAIServing


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

    def _decode(self, tokens: list[int]) -> str:
        vocab_size = self.engine.processor.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(f"tokens: {bad[:3]} outside the vocabulary [0, {vocab_size})",
                           HTTPStatus.BAD_REQUEST, "tokens")
        return self.tokenizer.decode(tokens)
