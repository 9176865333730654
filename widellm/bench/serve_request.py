"""One streaming request of ``widellm bench serve`` against an OpenAI-compatible server.

By default a request carries only OpenAI's own fields, so any server that follows the spec
accepts it; vLLM/SGLang/widellm sampling extras (``ignore_eos``, ``min_tokens``, ``top_k``,
...) go out only when a flag asks for them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from http import HTTPStatus

import httpx

from widellm.bench.datasets import SampleRequest
from widellm.bench.serve_metrics import RequestRecord

COMPLETIONS_ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"
MODELS_ENDPOINT = "/v1/models"
SSE_DATA_PREFIX = "data:"
SSE_DONE = "[DONE]"
# Longest server error body kept in a record, so one bad reply cannot bloat the JSON.
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run shares.

    Attributes:
        api_url: the endpoint; one ending in ``chat/completions`` gets chat requests.
        model: the model name sent in every request.
        output_len: max tokens of a sample that does not carry its own.
        api_key: bearer token, or None.
        json_schema: a JSON schema every output must follow (``response_format``), or None.
        ignore_eos: send ``ignore_eos`` (a vLLM/SGLang/widellm field).
        fixed_output_len: also send ``min_tokens`` = max tokens, so each request generates
            exactly its output length (implies ``ignore_eos``).
        logprobs: log probabilities per token to ask for, or None.
        extra_body: fields merged into every request (sampling parameters, ``--extra-body``).
        extra_headers: headers added to every request.
    """

    api_url: str
    model: str
    output_len: int | None = None
    api_key: str | None = None
    json_schema: dict | None = None
    ignore_eos: bool = False
    fixed_output_len: bool = False
    logprobs: int | None = None
    extra_body: dict | None = None
    extra_headers: dict | None = None

    @property
    def is_chat(self) -> bool:
        return self.api_url.rstrip("/").endswith("chat/completions")

    def headers(self) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {**headers, **(self.extra_headers or {})}


def build_payload(settings: RequestSettings, sample: SampleRequest) -> dict:
    """The JSON body of one streaming request."""
    max_tokens = sample.output_len if sample.output_len is not None else settings.output_len
    payload: dict = {"model": settings.model, "stream": True,
                     "stream_options": {"include_usage": True}}
    if settings.is_chat:
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        payload["prompt"] = sample.prompt
    if max_tokens is not None:
        payload["max_tokens"] = max_tokens
        if settings.is_chat:
            # The newer OpenAI name; max_tokens stays for servers that know only that one.
            payload["max_completion_tokens"] = max_tokens
    if settings.ignore_eos or settings.fixed_output_len:
        payload["ignore_eos"] = True
    if settings.fixed_output_len and max_tokens is not None:
        payload["min_tokens"] = max_tokens
    if settings.logprobs is not None:
        if settings.is_chat:
            payload.update(logprobs=True, top_logprobs=settings.logprobs)
        else:
            payload["logprobs"] = settings.logprobs
    if settings.json_schema is not None:
        payload["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "bench", "schema": settings.json_schema}}
    payload.update(settings.extra_body or {})
    return payload


def parse_sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line; None for blank, comment or other field lines."""
    line = line.strip()
    if not line.startswith(SSE_DATA_PREFIX):
        return None
    return line[len(SSE_DATA_PREFIX):].strip()


def chunk_text(chunk: dict) -> str:
    """Generated text carried by a completions or chat stream chunk ('' for none)."""
    parts = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        # Reasoning models stream their thinking separately; it is still generated tokens.
        parts.append(choice.get("text") or delta.get("content")
                     or delta.get("reasoning_content") or "")
    return "".join(parts)


def chunk_finished(chunk: dict) -> bool:
    """Whether a stream chunk closes a choice (carries a finish reason)."""
    return any(choice.get("finish_reason") for choice in chunk.get("choices") or [])


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` with every run of whitespace (newlines included) made one space, cut to
    ``limit`` characters: error messages stay on one terminal line."""
    return " ".join(text.split())[:limit]


async def send_request(
    client: httpx.AsyncClient, settings: RequestSettings, sample: SampleRequest
) -> RequestRecord:
    """Stream one request and time its chunks; any failure lands in ``record.error``.

    Only chunks carrying text count as tokens arriving (a chat stream's role-only first
    delta does not; a text-less finish chunk only when no text came). Token counts come
    from the server's usage chunk when it sends one; otherwise the output is one token per
    chunk until the caller recounts it with a tokenizer (see
    ``RequestRecord.usage_reported``).
    """
    record = RequestRecord(prompt_len=sample.prompt_len)
    num_chunks = 0
    usage_tokens: int | None = None
    texts: list[str] = []
    start = last = time.perf_counter()
    record.start_time = start
    try:
        async with client.stream("POST", settings.api_url, json=build_payload(settings, sample),
                                 headers=settings.headers()) as response:
            if response.status_code != HTTPStatus.OK:
                body = (await response.aread()).decode(errors="replace")
                record.error = one_line(f"HTTP {response.status_code}: {body}")
                return record
            async for line in response.aiter_lines():
                data = parse_sse_data(line)
                if not data:
                    continue
                if data == SSE_DONE:
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = one_line(f"stream error: {chunk['error']}")
                    return record
                now = time.perf_counter()
                text = chunk_text(chunk)
                # A finish chunk with no text stands for the output's arrival only when no
                # text came before: all its tokens decoded to nothing (special tokens, cut
                # UTF-8). After text, it is an end marker, not a token.
                if text or (num_chunks == 0 and chunk_finished(chunk)):
                    if num_chunks == 0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                    num_chunks += 1
                    texts.append(text)
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    record.prompt_len = usage.get("prompt_tokens", record.prompt_len)
        record.latency = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 -- one broken request must not end the benchmark
        record.error = one_line(f"{type(e).__name__}: {e}")
        return record
    record.generated_text = "".join(texts)
    if num_chunks == 0:
        record.error = "stream ended without any generated text or finish reason"
        return record
    record.usage_reported = usage_tokens is not None
    record.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
    record.success = True
    return record
