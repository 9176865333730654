"""A minimal third-party OpenAI-compatible server for ``widellm bench serve`` tests: it knows
only the fields of OpenAI's API reference for ``/v1/completions`` and
``/v1/chat/completions`` and answers any other field with a 400, as OpenAI does, so a client
that slips in ``ignore_eos``, ``min_tokens`` or ``top_k`` fails against it.

Each "token" it generates is one word (`` w0 w1 ...``); prompt tokens are counted as
whitespace-separated words, which is exact for the word-level tokenizer of
``bench_utils.word_level_tokenizer``.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

STUB_MODEL = "stub-org/stub-model"
# OpenAI's default when a request gives no limit.
DEFAULT_MAX_TOKENS = 16
FIRST_TOKEN_DELAY_S = 0.02
TOKEN_DELAY_S = 0.002
# Request fields of OpenAI's API reference (create completion, create chat completion).
COMPLETIONS_FIELDS = frozenset({
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
    "suffix", "temperature", "top_p", "user",
})
CHAT_FIELDS = frozenset({
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier",
    "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
})
STREAM_OPTIONS_FIELDS = frozenset({"include_usage", "include_obfuscation"})


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": param, "code": None}}, status_code=status)


def _count_words(content) -> int:
    if isinstance(content, str):
        return len(content.split())
    if isinstance(content, list):  # token ids, or content parts
        return sum(_count_words(p.get("text", "")) if isinstance(p, dict) else 1
                   for p in content)
    return 0


def _check(payload, fields: frozenset[str]) -> JSONResponse | None:
    if not isinstance(payload, dict):
        return _error(400, "the request body must be a JSON object")
    unknown = sorted(set(payload) - fields)
    if unknown:
        return _error(400, f"Unrecognized request argument supplied: {', '.join(unknown)}",
                      unknown[0])
    options = payload.get("stream_options")
    if options is not None and (not payload.get("stream") or not isinstance(options, dict)
                                or set(options) - STREAM_OPTIONS_FIELDS):
        return _error(400, "invalid stream_options", "stream_options")
    if payload.get("model") != STUB_MODEL:
        return _error(404, f"The model `{payload.get('model')}` does not exist", "model")
    return None


def make_stub_app() -> FastAPI:
    """The stub; every accepted request body is appended to ``app.state.payloads``."""
    app = FastAPI()
    app.state.payloads = []

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def respond(payload: dict, chat: bool):
        limit = payload.get("max_completion_tokens") or payload.get("max_tokens")
        words = [f" w{i}" for i in range(limit or DEFAULT_MAX_TOKENS)]
        prompt = (sum(_count_words(m.get("content")) for m in payload["messages"]) if chat
                  else _count_words(payload["prompt"]))
        usage = {"prompt_tokens": prompt, "completion_tokens": len(words),
                 "total_tokens": prompt + len(words)}
        base = {"id": "cmpl-stub", "created": int(time.time()), "model": STUB_MODEL,
                "object": "chat.completion.chunk" if chat else "text_completion"}
        if not payload.get("stream"):
            text = "".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"} if chat
                      else {"index": 0, "text": text, "finish_reason": "length"})
            return {**base, "object": "chat.completion" if chat else "text_completion",
                    "choices": [choice], "usage": usage}

        def choice(text: str | None, finish: str | None = None) -> dict:
            if chat:
                delta = {"content": text} if text is not None else {"role": "assistant"}
                return {"index": 0, "delta": delta, "finish_reason": finish}
            return {"index": 0, "text": text or "", "finish_reason": finish}

        async def stream():
            if chat:
                yield sse({**base, "choices": [choice(None)]})
            for i, word in enumerate(words):
                await asyncio.sleep(FIRST_TOKEN_DELAY_S if i == 0 else TOKEN_DELAY_S)
                yield sse({**base, "choices": [choice(word)]})
            yield sse({**base, "choices": [choice("" if chat else None, "length")]})
            if (payload.get("stream_options") or {}).get("include_usage"):
                yield sse({**base, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def handle(request: Request, fields: frozenset[str], chat: bool):
        try:
            payload = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        if (rejection := _check(payload, fields)) is not None:
            return rejection
        app.state.payloads.append(payload)
        return respond(payload, chat)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": STUB_MODEL, "object": "model",
                                            "created": 0, "owned_by": "stub"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, COMPLETIONS_FIELDS, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, CHAT_FIELDS, chat=True)

    return app
