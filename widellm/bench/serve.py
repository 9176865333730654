"""``widellm bench serve``: an asyncio load generator for any OpenAI-compatible server
(widellm, ``vllm serve``, SGLang, ...), with the flags and result JSON of ``vllm bench serve``.

Every request streams, so the client sees each token chunk arrive: time to first token,
inter-token gaps and end-to-end latency are measured per request, then summarised by
:mod:`widellm.bench.serve_metrics`. Prompts are text by default (random token ids decoded,
as vLLM does), and requests carry only OpenAI's fields unless a flag asks for an extra
(:mod:`widellm.bench.serve_request`). A failed request is recorded, never raised.

As in ``vllm bench serve``, one prompt is sent alone before the timed run (retried while
the server is not yet listening) so that a misconfigured run stops early, with a one-line
error, and no engine's first-request costs land in the timings; ``--num-warmups`` adds
untimed requests at the run's concurrency. Their prompts are drawn after the timed ones, so
they never give a timed prompt a prefix-cache hit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import random
import sys
import time
from datetime import datetime

import httpx
from tqdm.auto import tqdm

from widellm.bench.datasets import (
    SampleRequest, prefix_repetition_samples, random_samples, sharegpt_samples,
)
from widellm.bench.serve_args import (
    API_KEY_ENV, DEFAULT_READY_CHECK_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, resolve_args,
)
from widellm.bench.serve_metrics import RequestRecord, compute_metrics, format_summary
from widellm.bench.serve_request import (
    CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, MODELS_ENDPOINT, RequestSettings, build_payload,
    chunk_text, one_line, parse_sse_data, send_request,
)
from widellm.bench.serve_result import DATE_FORMAT, build_result, result_path, write_result

__all__ = [  # the names other modules and benchmarks/ scripts import from here
    "API_KEY_ENV", "CHAT_ENDPOINT", "COMPLETIONS_ENDPOINT", "DEFAULT_READY_CHECK_TIMEOUT_S",
    "DEFAULT_REQUEST_TIMEOUT_S", "MODELS_ENDPOINT", "BenchServeError", "RequestSettings",
    "SampleRequest", "arrival_offsets", "benchmark", "build_payload", "build_samples",
    "chunk_text", "fetch_first_model", "main", "parse_sse_data", "send_request",
    "wait_until_ready",
]

READY_POLL_S = 1.0
# How send_request reports a server that does not listen yet (httpx exception names): the
# only failures the ready check waits out; any other means the run is misconfigured.
NOT_LISTENING_ERRORS = ("ConnectError", "ConnectTimeout")
# Streams of the arrival schedule and of the prefix-repetition run's untimed prompts, apart
# from the prompts' own.
UNTIMED_SEED_OFFSET = 1


class BenchServeError(ValueError):
    """A run that cannot start (server unreachable or rejecting the test request, no model,
    no tokenizer). A ValueError so that the CLI prints it as one line, not a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message, limit=len(message)))


def arrival_offsets(num_requests: int, request_rate: float, seed: int,
                    burstiness: float = 1.0) -> list[float]:
    """Seconds after the start at which each request is sent (the first at 0): gaps drawn
    from a gamma distribution of mean 1 / ``request_rate`` and shape ``burstiness`` (1 is a
    Poisson process, below 1 burstier, infinite evenly spaced), as in ``vllm bench serve``;
    all at 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += (1.0 / request_rate if math.isinf(burstiness)
                  else rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)))
        offsets.append(t)
    return offsets


async def benchmark(
    settings: RequestSettings,
    samples: list[SampleRequest],
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
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
        arrival = time.perf_counter()
        if limiter is None:
            record = await send_request(client, settings, sample)
        else:
            async with limiter:
                record = await send_request(client, settings, sample)
        record.queue_time = record.start_time - arrival
        progress.update(1)
        return record

    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout),
                                 limits=limits) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        offsets = arrival_offsets(len(samples), request_rate, seed, burstiness)
        for offset, sample in zip(offsets, samples):
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
    stream error) raises BenchServeError at once with the server's reason."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout)) as client:
        while True:
            record = await send_request(client, settings, sample)
            if record.success:
                return record
            waiting = record.error.startswith(NOT_LISTENING_ERRORS)
            if not waiting or time.monotonic() + READY_POLL_S > deadline:
                raise BenchServeError(f"the initial test request to {settings.api_url} "
                                      f"failed: {record.error}")
            await asyncio.sleep(READY_POLL_S)


def fetch_first_model(base_url: str, api_key: str | None, timeout: float) -> str:
    """The id of the first model the server lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + MODELS_ENDPOINT
    try:
        response = httpx.get(url, headers=headers, timeout=timeout)
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise BenchServeError(f"could not list the server's models at {url} (pass --model "
                              f"to skip this): {type(e).__name__}: {e}") from None
    if not models:
        raise BenchServeError(f"{url} lists no models; pass --model")
    return models[0]["id"]


def resolve_tokenizer_id(args: argparse.Namespace, model_id: str) -> str | None:
    """The tokenizer to build prompts and count tokens with: ``--tokenizer``, else
    ``--model`` or the server's model when it is a local path (as vLLM uses the model's),
    else widellm's default model's; None for token-id prompts with ``--vocab-size``."""
    from widellm.model.default_model import DEFAULT_MODEL_NAME

    if args.tokenizer is not None:
        return args.tokenizer
    for candidate in (args.model, model_id):
        if candidate and (os.path.exists(candidate) or candidate == DEFAULT_MODEL_NAME):
            return candidate
    if args.token_id_prompts and args.vocab_size is not None:
        return None
    print(f"No local tokenizer for model {model_id!r}: prompts and token counts use "
          f"{DEFAULT_MODEL_NAME}'s (pass --tokenizer to choose one)")
    return DEFAULT_MODEL_NAME


def load_tokenizer(tokenizer_id: str | None):
    if tokenizer_id is None:
        return None
    from widellm.engine.tokenizer import get_tokenizer

    try:
        return get_tokenizer(tokenizer_id)
    except (OSError, ValueError) as e:
        raise BenchServeError(f"cannot load tokenizer {tokenizer_id!r}: {e}") from None


def build_samples(args: argparse.Namespace, tokenizer,
                  num_untimed: int = 0) -> tuple[list[SampleRequest], list[SampleRequest]]:
    """The ``--num-prompts`` timed prompts of ``--dataset-name``, and ``num_untimed`` more
    that share no prefix with them (drawn after them from the same seed, or, for
    prefix_repetition, random prompts of the same length from another seed)."""
    num = args.num_prompts
    if args.dataset_name == "sharegpt":
        samples = sharegpt_samples(
            args.dataset_path, num + num_untimed, tokenizer, seed=args.seed,
            output_len=args.sharegpt_output_len, shuffle=not args.disable_shuffle,
            oversample=not args.no_oversample)
        return samples[:num], samples[num:]
    random_kwargs = dict(input_len=args.random_input_len, output_len=args.random_output_len,
                         range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len,
                         vocab_size=args.vocab_size, tokenizer=tokenizer,
                         as_text=not args.token_id_prompts)
    if args.dataset_name == "random":
        samples = random_samples(num + num_untimed, seed=args.seed, **random_kwargs)
        return samples[:num], samples[num:]
    timed = prefix_repetition_samples(
        num, tokenizer, prefix_len=args.prefix_repetition_prefix_len,
        suffix_len=args.prefix_repetition_suffix_len,
        num_prefixes=args.prefix_repetition_num_prefixes,
        output_len=args.prefix_repetition_output_len, seed=args.seed,
        shuffle=not args.disable_shuffle)
    random_kwargs.update(
        input_len=args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len,
        output_len=args.prefix_repetition_output_len, range_ratio=0.0, prefix_len=0)
    return timed, random_samples(num_untimed, seed=args.seed + UNTIMED_SEED_OFFSET,
                                 **random_kwargs)


def recount_output_tokens(records: list[RequestRecord], tokenizer) -> None:
    """Where the server sent no usage, count the generated text with the tokenizer (as vLLM
    does) rather than trusting one token per chunk."""
    if tokenizer is None:
        return
    for r in records:
        if r.success and not r.usage_reported:
            r.output_tokens = len(tokenizer.encode(r.generated_text, add_special_tokens=False))


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark described by ``args``; print the summary and return the result
    dict (vLLM's keys), also written where ``--save-result``/``--output-json`` say."""
    resolve_args(args)
    # httpx logs every request at INFO: thousands of lines that would bury the summary and
    # turn a one-line error into several.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_id = args.model or fetch_first_model(args.base_url, args.api_key,
                                               args.request_timeout)
    tokenizer_id = resolve_tokenizer_id(args, model_id)
    tokenizer = load_tokenizer(tokenizer_id)
    settings = RequestSettings(
        api_url=args.base_url + args.endpoint, model=args.served_model_name or model_id,
        api_key=args.api_key, json_schema=args.json_schema, ignore_eos=args.ignore_eos,
        fixed_output_len=args.fixed_output_len, logprobs=args.logprobs,
        extra_body=args.request_extra_body, extra_headers=args.extra_headers,
    )
    samples, untimed = build_samples(args, tokenizer, num_untimed=1 + args.num_warmups)
    test_sample, warmups = untimed[0], untimed[1:]
    if args.ready_check_timeout_sec > 0:
        print(f"Sending one test prompt to {settings.api_url} ...")
        asyncio.run(wait_until_ready(settings, test_sample, args.ready_check_timeout_sec,
                                     args.request_timeout))
    if warmups:
        print(f"Warming up with {len(warmups)} requests ...")
        asyncio.run(benchmark(settings, warmups, max_concurrency=args.max_concurrency,
                              request_timeout=args.request_timeout))
    print(f"Benchmarking {settings.api_url} (model {settings.model}): {len(samples)} prompts "
          f"of {args.dataset_name}, request rate {args.request_rate}, burstiness "
          f"{args.burstiness}, max concurrency {args.max_concurrency}")
    records, duration = asyncio.run(benchmark(
        settings, samples, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed,
        request_timeout=args.request_timeout, disable_tqdm=args.disable_tqdm,
    ))
    recount_output_tokens(records, tokenizer)
    metrics = compute_metrics(records, duration, args.percentiles, args.goodput_slos)
    print(format_summary(metrics, args.selected_metrics, args.max_concurrency,
                         args.request_rate))
    if metrics.failed:
        first_error = next(r.error for r in records if not r.success)
        print(f"{metrics.failed} request(s) failed; the first: {first_error}")
    date = datetime.now().strftime(DATE_FORMAT)
    result = build_result(args, date=date, model_id=model_id, tokenizer_id=tokenizer_id,
                          records=records, metrics=metrics)
    if path := result_path(args, model_id, date):
        write_result(path, result, append=args.append_result and not args.output_json)
        print(f"Result written to {path}")
    return result


def _cli() -> None:
    from widellm.bench.serve_args import add_cli_args

    parser = argparse.ArgumentParser(prog="python -m widellm.bench.serve",
                                     description=__doc__.splitlines()[0])
    add_cli_args(parser)
    try:
        main(parser.parse_args())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    _cli()
