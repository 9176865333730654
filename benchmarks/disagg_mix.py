"""Latency under interference, for issue 23: many requests decode while long prompts arrive.

Sends, against one OpenAI-compatible URL (a colocated server, or ``widellm proxy`` in front
of a prefill and a decode instance), two streams at once:
  * decoders: ``--num-decoders`` requests of ``--decoder-input-len`` tokens generating
    ``--decoder-output-len``, ``--decoder-concurrency`` in flight;
  * long prompts: ``--num-long`` prompts of ``--long-input-len`` tokens (``--long-output-len``
    out), one every ``--long-interval-s`` seconds, starting once the decoders run.
Prints (and writes as JSON) p50/p99 inter-token latency of the decoders, p99 TTFT of each
stream, and output tokens per second over the run.

Usage: python benchmarks/disagg_mix.py --base-url http://127.0.0.1:8000 --vocab-size 49152
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np

from widellm.bench.datasets import random_token_prompts
from widellm.bench.serve import (
    COMPLETIONS_ENDPOINT, RequestSettings, SampleRequest, fetch_first_model, send_request,
)

MS = 1000.0


async def _run(args: argparse.Namespace) -> dict:
    model = fetch_first_model(args.base_url, None, 60.0)
    url = args.base_url + COMPLETIONS_ENDPOINT
    # Greedy, and exactly the asked-for output lengths (ignore_eos + min_tokens), so every
    # setup decodes the same number of tokens.
    fixed = dict(fixed_output_len=True, extra_body={"temperature": 0.0})
    dec = RequestSettings(url, model, args.decoder_output_len, **fixed)
    long = RequestSettings(url, model, args.long_output_len, **fixed)
    dec_prompts = random_token_prompts(args.num_decoders, args.decoder_input_len,
                                       args.vocab_size, seed=args.seed)
    long_prompts = random_token_prompts(args.num_long, args.long_input_len, args.vocab_size,
                                        seed=args.seed + 1)
    limiter = asyncio.Semaphore(args.decoder_concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        async def decoder(p):
            async with limiter:
                return await send_request(client, dec, SampleRequest(p, len(p)))

        async def long_prompts_stream():
            await asyncio.sleep(args.long_start_s)
            tasks = []
            for i, p in enumerate(long_prompts):
                if i:
                    await asyncio.sleep(args.long_interval_s)
                tasks.append(asyncio.create_task(
                    send_request(client, long, SampleRequest(p, len(p)))))
            return await asyncio.gather(*tasks)

        start = time.perf_counter()
        dec_task = asyncio.gather(*(decoder(p) for p in dec_prompts))
        long_records, dec_records = await asyncio.gather(long_prompts_stream(), dec_task)
        duration = time.perf_counter() - start
    failed = [r.error for r in [*dec_records, *long_records] if not r.success]
    itl = [g for r in dec_records for g in r.itl]
    out_tokens = sum(r.output_tokens for r in [*dec_records, *long_records])
    return {
        "failed": len(failed), "first_error": failed[0] if failed else "",
        "duration_s": duration,
        "output_tok_s": out_tokens / duration,
        "decoder_itl_p50_ms": float(np.percentile(itl, 50) * MS) if itl else 0.0,
        "decoder_itl_p99_ms": float(np.percentile(itl, 99) * MS) if itl else 0.0,
        "decoder_ttft_p99_ms": float(np.percentile([r.ttft for r in dec_records], 99) * MS),
        "long_ttft_p99_ms": float(np.percentile([r.ttft for r in long_records], 99) * MS),
        "long_ttft_p50_ms": float(np.percentile([r.ttft for r in long_records], 50) * MS),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--num-decoders", type=int, default=48)
    p.add_argument("--decoder-concurrency", type=int, default=16)
    p.add_argument("--decoder-input-len", type=int, default=64)
    p.add_argument("--decoder-output-len", type=int, default=128)
    p.add_argument("--num-long", type=int, default=4)
    p.add_argument("--long-input-len", type=int, default=2048)
    p.add_argument("--long-output-len", type=int, default=8)
    p.add_argument("--long-interval-s", type=float, default=4.0)
    p.add_argument("--long-start-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    result = asyncio.run(_run(args))
    print(json.dumps(result, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "result": result}, f, indent=1)


if __name__ == "__main__":
    main()
