"""A soak of a running ``widellm serve``: a seeded random mix of requests, then the checks a
user would make after a burst of traffic.

The mix: completions (n of 1-3, logprobs, stop strings, ``return_token_ids`` checked against
the usage counts, ``truncate_prompt_tokens``), streamed completions and chats,
chats, JSON-schema chats (structured outputs), chats with tools and a ``required`` or named
``tool_choice`` (plain or streamed; every call that was not cut by max_tokens must name a tool
given and carry arguments that parse to the function's required fields), streams the client
drops after a few chunks (aborts), and malformed requests (negative max_tokens) that must get
a 400. Prompts of 1 to
``--max-words`` words; temperatures 0, 0.7 and 1; seeds or none.

Checks: no request fails with a 5xx or a transport error, every malformed one gets a 400, a
valid one gets a 400 only for a length the server cannot hold (counted apart), and afterwards
the server is idle: no running or waiting request and no KV block in use, on every rank
(``/metrics``). Exit status 1 if any check fails.

Usage (a DP2 + EP server with everything on, then the soak):
    widellm serve MODEL --data-parallel-size 2 --enable-expert-parallel --async-scheduling \\
        --enable-dbo on --enable-eplb --enable-prefix-caching --num-kv-blocks 40 ...
    python benchmarks/soak.py http://127.0.0.1:8000 --requests 600 --concurrency 64

Through ``widellm proxy`` (disaggregated prefill/decode), the idle check reads each instance:
    python benchmarks/soak.py http://127.0.0.1:8000 --idle-url http://127.0.0.1:8100 \
        --idle-url http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx
import openai

WORDS = ("the a capital of france is paris river mountain sky blue green code python engine"
         .split())
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"look up the {name.split('_')[1]} of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}} for name in ("get_weather", "get_population")]
KINDS = ("completion", "completion_stream", "chat", "chat_stream", "abort", "json", "tools",
         "malformed")
IDLE_GAUGES = ("widellm:num_requests_running", "widellm:num_requests_waiting",
               "widellm:kv_cache_usage_perc")
IDLE_WAIT_S = 20.0
POLL_S = 0.2
# The most chunks a dropped stream reads before the client goes away.
MAX_CHUNKS_BEFORE_ABORT = 5


class Tally:
    def __init__(self) -> None:
        self.counts = {"ok": 0, "aborted": 0, "rejected_malformed": 0, "too_long": 0,
                       "tool_calls_checked": 0, "tool_calls_cut": 0}
        self.failures: list[str] = []


def _prompt(r: random.Random, max_words: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(1, max_words)))


async def _drain(stream) -> int:
    chunks = 0
    async for _ in stream:
        chunks += 1
    return chunks


def _named(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["function"]["name"]}}


async def _tool_calls(client: openai.AsyncOpenAI, model: str, r: random.Random, chat: list,
                      common: dict) -> tuple[list[tuple[str, str]], str]:
    """A chat with TOOLS and a required or named tool_choice, plain or streamed: its tool
    calls as (name, arguments) and its finish reason."""
    choice = r.choice(["required", _named(r.choice(TOOLS))])
    kwargs = dict(model=model, messages=chat, tools=TOOLS, tool_choice=choice, **common)
    if r.random() < 0.5:
        out = await client.chat.completions.create(**kwargs)
        message = out.choices[0].message
        return ([(c.function.name, c.function.arguments) for c in message.tool_calls or []],
                out.choices[0].finish_reason)
    calls: dict[int, list[str]] = {}  # index -> [name, arguments so far]
    finish = ""
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for delta_choice in chunk.choices:
            finish = delta_choice.finish_reason or finish
            for call in delta_choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                if call.function is not None:
                    entry[0] += call.function.name or ""
                    entry[1] += call.function.arguments or ""
    return [(name, arguments) for name, arguments in calls.values()], finish


def _tool_call_error(calls: list[tuple[str, str]], finish: str) -> str | None:
    """What is wrong with a forced tool call's outcome, or None."""
    if finish == "length":  # cut by max_tokens: the arguments may be a prefix
        return None
    if not calls:
        return f"no tool call (finish_reason {finish!r})"
    names = {t["function"]["name"] for t in TOOLS}
    for name, arguments in calls:
        if name not in names:
            return f"a call of {name!r}, not a tool given"
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return f"arguments that are not JSON: {arguments[:80]!r}"
        if not isinstance(parsed, dict) or not isinstance(parsed.get("city"), str):
            return f"arguments without the required string 'city': {arguments[:80]!r}"
    return None


def _token_ids_error(out, n: int, keep: int | None) -> str | None:
    """What is wrong with a completion's choices and ids against its usage, or None."""
    if len(out.choices) != n:
        return f"{len(out.choices)} choices for n={n}"
    prompts = {len(c.prompt_token_ids or []) for c in out.choices}
    if prompts != {out.usage.prompt_tokens} or (keep is not None and max(prompts) > keep):
        return f"prompt ids of {prompts} tokens, usage {out.usage.prompt_tokens}, keep {keep}"
    generated = sum(len(c.token_ids or []) for c in out.choices)
    if generated != out.usage.completion_tokens:
        return f"{generated} generated ids, usage {out.usage.completion_tokens}"
    return None


async def one(client: openai.AsyncOpenAI, model: str, i: int, args, tally: Tally) -> None:
    r = random.Random(args.seed * 1_000_003 + i)
    kind = r.choice(KINDS)
    common = dict(max_tokens=r.randint(1, 60), temperature=r.choice([0, 0.7, 1.0]),
                  seed=r.choice([None, r.randint(0, 99)]))
    chat = [{"role": "user", "content": _prompt(r, args.max_words)}]
    text = _prompt(r, args.max_words)
    try:
        if kind == "completion":
            n = r.randint(1, 3)
            keep = r.choice([None, r.randint(1, 8)])
            out = await client.completions.create(
                model=model, prompt=text, n=n, logprobs=r.choice([None, 2]),
                stop=r.choice([None, ["river"], ["."]]), **common,
                extra_body={"return_token_ids": True, "truncate_prompt_tokens": keep})
            error = _token_ids_error(out, n, keep)
            if error is not None:
                tally.failures.append(f"#{i} {kind}: {error}")
                return
        elif kind == "completion_stream":
            await _drain(await client.completions.create(
                model=model, prompt=text, stream=True, n=r.randint(1, 2), **common))
        elif kind == "chat":
            await client.chat.completions.create(model=model, messages=chat, **common)
        elif kind == "chat_stream":
            await _drain(await client.chat.completions.create(
                model=model, messages=chat, stream=True, **common))
        elif kind == "json":
            await client.chat.completions.create(
                model=model, messages=chat, **common,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "person", "schema": SCHEMA}})
        elif kind == "tools":
            # Room for a whole call: a random model fills the argument string at length.
            calls, finish = await _tool_calls(client, model, r, chat,
                                              common | {"max_tokens": r.randint(100, 400)})
            tally.counts["tool_calls_checked" if finish != "length" else "tool_calls_cut"] += 1
            error = _tool_call_error(calls, finish)
            if error is not None:
                tally.failures.append(f"#{i} {kind}: {error}")
                return
        elif kind == "abort":
            stream = await client.completions.create(model=model, prompt=text, stream=True,
                                                     max_tokens=200)
            stop_after, read = r.randint(1, MAX_CHUNKS_BEFORE_ABORT), 0
            async for _ in stream:
                read += 1
                if read >= stop_after:
                    break
            await stream.close()
            tally.counts["aborted"] += 1
            return
        else:  # malformed
            try:
                await client.completions.create(model=model, prompt=text, max_tokens=-1)
            except openai.BadRequestError:
                tally.counts["rejected_malformed"] += 1
            else:
                tally.failures.append(f"#{i}: max_tokens=-1 was accepted")
            return
        tally.counts["ok"] += 1
    except openai.BadRequestError as e:
        if "max_model_len" in str(e):  # a prompt (plus max_tokens) longer than the server holds
            tally.counts["too_long"] += 1
        else:
            tally.failures.append(f"#{i} {kind}: 400 {str(e)[:200]}")
    except Exception as e:  # noqa: BLE001 - every other outcome is a failure to report
        tally.failures.append(f"#{i} {kind}: {e!r}"[:300])


async def wait_idle(url: str) -> dict[str, float] | None:
    """The idle gauges summed over ranks, once all are 0 (or after IDLE_WAIT_S); None when
    ``url`` has none of them (a proxy: its instances are to be checked)."""
    deadline = time.monotonic() + IDLE_WAIT_S
    async with httpx.AsyncClient() as http:
        while True:
            text = (await http.get(url + "/metrics")).text
            values = dict.fromkeys(IDLE_GAUGES, 0.0)
            seen = False
            for line in text.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in values:
                    values[name] += float(line.rsplit(" ", 1)[-1])
                    seen = True
            if not seen:
                return None
            if not any(values.values()) or time.monotonic() > deadline:
                return values
            await asyncio.sleep(POLL_S)


async def main(args) -> int:
    client = openai.AsyncOpenAI(base_url=args.url + "/v1", api_key=args.api_key,
                                timeout=args.request_timeout_s, max_retries=0)
    model = (await client.models.list()).data[0].id
    tally, gate = Tally(), asyncio.Semaphore(args.concurrency)

    async def gated(i: int) -> None:
        async with gate:
            await one(client, model, i, args, tally)

    start = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(gated(i) for i in range(args.requests))),
                           args.timeout_s)
    elapsed = time.monotonic() - start
    idle = {}
    for url in args.idle_url or [args.url]:
        idle[url] = await wait_idle(url)
        if idle[url] is None:
            tally.failures.append(f"{url} has no {IDLE_GAUGES[0]} gauge (behind a proxy, "
                                  "name each instance with --idle-url)")
        elif any(idle[url].values()):
            tally.failures.append(f"{url} not idle {IDLE_WAIT_S:.0f} s after the last "
                                  f"request: {idle[url]}")
    print(json.dumps({**tally.counts, "failures": len(tally.failures),
                      "elapsed_s": round(elapsed, 1), "idle": idle}))
    for failure in tally.failures[:args.show]:
        print("FAIL", failure)
    return 1 if tally.failures else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-words", type=int, default=80, help="longest prompt, in words")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--timeout-s", type=float, default=900.0, help="for the whole soak")
    p.add_argument("--idle-url", action="append", default=None,
                   help="a server whose ranks must be idle afterwards (repeatable; default: "
                        "url). Behind `widellm proxy`, each prefill and decode instance")
    p.add_argument("--show", type=int, default=20, help="failures to print")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
