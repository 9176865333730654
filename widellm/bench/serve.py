"""``widellm bench serve``: an asyncio load generator for any OpenAI-compatible server
(widellm, ``vllm serve``, SGLang, ...).

Every request streams, so the client sees each token chunk arrive: time to first token,
inter-token gaps and end-to-end latency are measured per request, then summarised by
:mod:`widellm.bench.serve_metrics`. Prompts are random token ids (the same list on every
engine); ``ignore_eos`` plus ``min_tokens`` make every engine generate exactly
``--output-len`` tokens. A failed request is recorded, never raised.

As in ``vllm bench serve``, one prompt is sent alone before the timed run (retried while
the server is not yet listening) so that a misconfigured run stops early and no engine's
first-request costs land in the timings; ``--num-warmups`` adds untimed requests at the
run's concurrency. Their prompts are drawn after the timed ones, so they never give a timed
prompt a prefix-cache hit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from http import HTTPStatus

import httpx
from tqdm.auto import tqdm

from widellm.bench.datasets import random_token_prompts
from widellm.bench.serve_metrics import (
    RequestRecord,
    compute_metrics,
    format_summary,
    metrics_to_dict,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
COMPLETIONS_ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"
MODELS_ENDPOINT = "/v1/models"
API_KEY_ENV = "OPENAI_API_KEY"
# Per request; long enough that only a hung server ever hits it.
DEFAULT_REQUEST_TIMEOUT_S = 3600.0
SSE_DATA_PREFIX = "data:"
SSE_DONE = "[DONE]"
# Longest server error body kept in a record, so one bad reply cannot bloat the JSON.
MAX_ERROR_CHARS = 500
DEFAULT_READY_CHECK_TIMEOUT_S = 600.0
READY_POLL_S = 1.0
# How send_request reports a server that does not listen yet (httpx exception names): the
# only failures the ready check waits out; any other means the run is misconfigured.
NOT_LISTENING_ERRORS = ("ConnectError", "ConnectTimeout")


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to send: token ids for completions, text for chat."""

    prompt: list[int] | str
    prompt_len: int


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run shares."""

    api_url: str
    model: str
    output_len: int
    temperature: float = 0.0
    api_key: str | None = None
    # A JSON schema every request's output must follow (response_format), or None.
    json_schema: dict | None = None

    @property
    def is_chat(self) -> bool:
        return self.api_url.rstrip("/").endswith("chat/completions")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_payload(settings: RequestSettings, sample: SampleRequest) -> dict:
    """The JSON body of one streaming request."""
    payload: dict = {
        "model": settings.model,
        "max_tokens": settings.output_len,
        # Both extras are vLLM/SGLang/widellm sampling fields: generate exactly output_len.
        "min_tokens": settings.output_len,
        "ignore_eos": True,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.is_chat:
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
        # The newer OpenAI name for chat; servers that know only max_tokens ignore it.
        payload["max_completion_tokens"] = settings.output_len
    else:
        payload["prompt"] = sample.prompt
    if settings.json_schema is not None:
        payload["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "bench", "schema": settings.json_schema}}
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


async def send_request(
    client: httpx.AsyncClient, settings: RequestSettings, sample: SampleRequest
) -> RequestRecord:
    """Stream one request and time its chunks; any failure lands in ``record.error``."""
    record = RequestRecord(prompt_len=sample.prompt_len)
    num_chunks = 0
    usage_tokens: int | None = None
    start = last = time.perf_counter()
    record.start_time = start
    try:
        async with client.stream("POST", settings.api_url, json=build_payload(settings, sample),
                                 headers=settings.headers()) as response:
            if response.status_code != HTTPStatus.OK:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:MAX_ERROR_CHARS]}"
                return record
            async for line in response.aiter_lines():
                data = parse_sse_data(line)
                if not data:
                    continue
                if data == SSE_DONE:
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {str(chunk['error'])[:MAX_ERROR_CHARS]}"
                    return record
                now = time.perf_counter()
                if chunk_text(chunk):
                    if num_chunks == 0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                    num_chunks += 1
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    record.prompt_len = usage.get("prompt_tokens", record.prompt_len)
        record.latency = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 -- one broken request must not end the benchmark
        record.error = f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
        return record
    if num_chunks == 0:
        record.error = "stream ended without any generated text"
        return record
    record.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
    record.success = True
    return record


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process of
    ``request_rate`` per second (the first at 0), or all at 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.expovariate(request_rate)
        offsets.append(t)
    return offsets


async def benchmark(
    settings: RequestSettings,
    samples: list[SampleRequest],
    *,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
    disable_tqdm: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send ``samples`` on the arrival schedule; return their records (in sample order) and
    the wall time from the first send to the last completion."""
    limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # The client's own pool must never queue a request the benchmark has released.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=None)
    progress = tqdm(total=len(samples), disable=disable_tqdm)

    async def one(client: httpx.AsyncClient, sample: SampleRequest) -> RequestRecord:
        if limiter is None:
            record = await send_request(client, settings, sample)
        else:
            async with limiter:
                record = await send_request(client, settings, sample)
        progress.update(1)
        return record

    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout),
                                 limits=limits) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        for offset, sample in zip(arrival_offsets(len(samples), request_rate, seed), samples):
            # Sleep to an absolute deadline so scheduling delays do not accumulate.
            await asyncio.sleep(max(0.0, start + offset - loop.time()))
            tasks.append(asyncio.create_task(one(client, sample)))
        records = await asyncio.gather(*tasks)
        duration = loop.time() - start
    progress.close()
    return list(records), duration


async def wait_until_ready(
    settings: RequestSettings, sample: SampleRequest, timeout_s: float,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
) -> RequestRecord:
    """Send ``sample`` alone until it succeeds; return its record. Retries only while the
    server does not listen, for at most ``timeout_s``; any other failure (an HTTP error, a
    stream error) raises at once with the server's reason."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout)) as client:
        while True:
            record = await send_request(client, settings, sample)
            if record.success:
                return record
            waiting = record.error.startswith(NOT_LISTENING_ERRORS)
            if not waiting or time.monotonic() + READY_POLL_S > deadline:
                raise RuntimeError(f"the initial test request to {settings.api_url} failed: "
                                   f"{record.error}")
            await asyncio.sleep(READY_POLL_S)


def fetch_first_model(base_url: str, api_key: str | None, timeout: float) -> str:
    """The id of the first model the server lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + MODELS_ENDPOINT, headers=headers,
                         timeout=timeout)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}{MODELS_ENDPOINT} lists no models; pass --model")
    return models[0]["id"]


def build_samples(
    args: argparse.Namespace, is_chat: bool, num_untimed: int = 0
) -> list[SampleRequest]:
    """``--num-prompts`` random token-id prompts, then ``num_untimed`` more drawn after them
    from the same seed (so the timed ones do not change); decoded to text for chat, which
    needs a tokenizer."""
    tokenizer_path = args.tokenizer
    if tokenizer_path is None and args.model and os.path.exists(args.model):
        tokenizer_path = args.model
    if tokenizer_path is None and (is_chat or args.vocab_size is None):
        need = "chat prompts are decoded" if is_chat else "the vocabulary size is unknown"
        raise ValueError(f"pass --tokenizer ({need}; --vocab-size alone serves completions)")
    tokenizer = None
    if tokenizer_path is not None:
        from widellm.engine.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(tokenizer_path)
    vocab_size = args.vocab_size if args.vocab_size is not None else len(tokenizer)
    ids = random_token_prompts(args.num_prompts + num_untimed, args.input_len, vocab_size,
                               args.seed)
    if is_chat:
        return [SampleRequest(tokenizer.decode(p), args.input_len) for p in ids]
    return [SampleRequest(p, args.input_len) for p in ids]


def _validate(args: argparse.Namespace) -> None:
    positive = {"--num-prompts": args.num_prompts, "--input-len": args.input_len,
                "--output-len": args.output_len, "--request-rate": args.request_rate,
                "--request-timeout": args.request_timeout}
    at_least_zero = {"--ready-check-timeout-sec": args.ready_check_timeout_sec,
                     "--num-warmups": args.num_warmups}
    if args.max_concurrency is not None:
        positive["--max-concurrency"] = args.max_concurrency
    for flag, value in positive.items():
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    for flag, value in at_least_zero.items():
        if not value >= 0:
            raise ValueError(f"{flag} must be at least 0, got {value}")


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark described by ``args``; print the summary and return it (with the
    per-request records under ``"requests"``), also written to ``--output-json``."""
    _validate(args)
    model = args.model or fetch_first_model(args.base_url, args.api_key, args.request_timeout)
    settings = RequestSettings(
        api_url=args.base_url.rstrip("/") + args.endpoint, model=model,
        output_len=args.output_len, temperature=args.temperature, api_key=args.api_key,
        json_schema=args.json_schema,
    )
    samples = build_samples(args, settings.is_chat, num_untimed=1 + args.num_warmups)
    samples, test_sample, warmups = (samples[:args.num_prompts], samples[args.num_prompts],
                                     samples[args.num_prompts + 1:])
    if args.ready_check_timeout_sec > 0:
        print(f"Sending one test prompt to {settings.api_url} ...")
        asyncio.run(wait_until_ready(settings, test_sample, args.ready_check_timeout_sec,
                                     args.request_timeout))
    if warmups:
        print(f"Warming up with {len(warmups)} requests ...")
        asyncio.run(benchmark(settings, warmups, max_concurrency=args.max_concurrency,
                              request_timeout=args.request_timeout))
    print(f"Benchmarking {settings.api_url} (model {model}): {len(samples)} prompts, "
          f"request rate {args.request_rate}, max concurrency {args.max_concurrency}")
    records, duration = asyncio.run(benchmark(
        settings, samples, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, seed=args.seed,
        request_timeout=args.request_timeout, disable_tqdm=args.disable_tqdm,
    ))
    metrics = compute_metrics(records, duration)
    print(format_summary(metrics))
    if metrics.failed:
        first_error = next(r.error for r in records if not r.success)
        print(f"{metrics.failed} request(s) failed; the first: {first_error}")
    result = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        # JSON has no infinity; keep the flag's spelling.
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "num_warmups": args.num_warmups,
        **metrics_to_dict(metrics),
        "requests": [asdict(r) for r in records],
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _cli() -> None:
    from widellm.bench.serve_args import add_cli_args

    parser = argparse.ArgumentParser(prog="python -m widellm.bench.serve",
                                     description=__doc__.splitlines()[0])
    add_cli_args(parser)
    main(parser.parse_args())


if __name__ == "__main__":
    _cli()
