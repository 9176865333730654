"""The OpenAI-compatible server run as a user runs it: ``widellm serve`` in a subprocess on a
tiny random model, driven by the official ``openai`` client (the API oracle) and raw httpx for
what the client hides (status codes, error bodies, SSE frames). Disconnects, the API key and
engine death run against a second server in ``test_api_server_keyed.py``."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

import widellm
from tests.e2e.server_harness import (
    MAX_MODEL_LEN, MAX_N, MODEL_ARCH, PROMPT, REQUEST_TIMEOUT_S, SERVED_NAME, metric, metrics,
    start_server,
)
from widellm.engine.tokenizer import get_tokenizer
from widellm.entrypoints.serving_base import DATA_PARALLEL_RANK_HEADER

IDLE_TIMEOUT_S = 20.0
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0}
IGNORE_EOS = {"ignore_eos": True}  # fixed output lengths from a random model
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from start_server(model_dir, tmp_path_factory, "server",
                            ["--served-model-name", SERVED_NAME])


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return get_tokenizer(model_dir(MODEL_ARCH))


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=REQUEST_TIMEOUT_S)


def _complete(client, prompt=PROMPT, max_tokens=8, **kwargs):
    return client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens,
                                     extra_body=IGNORE_EOS, **GREEDY, **kwargs)


def _chat(client, max_tokens=8, **kwargs):
    return client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES,
                                          max_tokens=max_tokens, extra_body=IGNORE_EOS,
                                          **GREEDY, **kwargs)


def _chat_prompt_len(tokenizer) -> int:
    return len(tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                             return_dict=False))


# ---- metrics -----------------------------------------------------------------------------------



# ---- completions and chat ----------------------------------------------------------------------

def test_completion_stream_equals_non_stream_with_exact_usage(client, tokenizer):
    whole = _complete(client)
    prompt_len = len(tokenizer(PROMPT).input_ids)
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.model == SERVED_NAME
    assert [c.index for c in whole.choices] == [0]
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens,
            whole.usage.total_tokens) == (prompt_len, 8, prompt_len + 8)

    chunks = list(_complete(client, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_token_id_prompts_and_several_prompts(client, tokenizer):
    text = _complete(client).choices[0].text
    ids = tokenizer(PROMPT).input_ids
    assert _complete(client, prompt=ids).choices[0].text == text
    other = "Once upon a time"
    other_text = _complete(client, prompt=other).choices[0].text
    both = _complete(client, prompt=[PROMPT, other], n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [text, text, other_text, other_text]
    assert both.usage.prompt_tokens == len(ids) + len(tokenizer(other).input_ids)
    assert both.usage.completion_tokens == 4 * 8
    by_ids = _complete(client, prompt=[ids, tokenizer(other).input_ids])
    assert [c.text for c in by_ids.choices] == [text, other_text]


def test_chat_stream_equals_non_stream(client, tokenizer):
    whole = _chat(client)
    prompt_len = _chat_prompt_len(tokenizer)
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    choice = whole.choices[0]
    assert (choice.index, choice.message.role, choice.finish_reason) == (0, "assistant", "length")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_len, 8)

    chunks = list(client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=8, extra_body=IGNORE_EOS,
        stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == choice.message.content
    assert [c.choices[0].finish_reason for c in body].count("length") == 1
    assert body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_n_2_gives_two_choices(client):
    completion = _complete(client, n=2)
    assert [c.index for c in completion.choices] == [0, 1]
    alone = _complete(client).choices[0].text
    assert completion.choices[0].text == completion.choices[1].text == alone  # greedy
    assert completion.usage.completion_tokens == 16

    chat = _chat(client, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    assert chat.usage.completion_tokens == 16

    seen: dict[int, list] = {0: [], 1: []}
    for chunk in _chat(client, n=2, stream=True):
        for c in chunk.choices:
            seen[c.index].append(c)
    for index, deltas in seen.items():
        assert deltas[0].delta.role == "assistant"
        assert [d.finish_reason for d in deltas][-1] == "length"
        assert "".join(d.delta.content or "" for d in deltas) == chat.choices[index].message.content


def test_completion_logprobs_and_echo(client, tokenizer):
    plain = _complete(client, max_tokens=4)
    out = _complete(client, max_tokens=4, logprobs=3)
    assert out.choices[0].text == plain.choices[0].text
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token_logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3
        assert max(top.values()) == token_logprob  # greedy picks the likeliest token

    echoed = _complete(client, max_tokens=4, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text

    prompt_len = len(tokenizer(PROMPT).input_ids)
    both = _complete(client, max_tokens=4, echo=True, logprobs=1).choices[0]
    assert both.text == PROMPT + plain.choices[0].text
    assert len(both.logprobs.tokens) == prompt_len + 4
    assert both.logprobs.token_logprobs[0] is None and both.logprobs.top_logprobs[0] is None
    assert all(x is not None for x in both.logprobs.token_logprobs[1:])
    assert both.logprobs.token_logprobs[prompt_len:] == lp.token_logprobs
    assert both.logprobs.text_offset[prompt_len] == len(PROMPT)
    for choice in _complete(client, max_tokens=4, echo=True, logprobs=1, n=2).choices:
        assert choice.logprobs.tokens == both.logprobs.tokens


def test_chat_logprobs(client):
    out = _chat(client, max_tokens=3, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert 1 <= len(entry.top_logprobs) <= 2
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy
        assert entry.bytes == list(entry.token.encode("utf-8"))
    assert _chat(client, max_tokens=3).choices[0].logprobs is None


def test_32_concurrent_streams_match_requests_run_alone(server, client):
    prompts = [f"Story number {i}:" for i in range(4)]
    alone = {p: _complete(client, prompt=p).choices[0].text for p in prompts}

    async def stream_one(aclient, prompt):
        stream = await aclient.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=8, stream=True, extra_body=IGNORE_EOS,
            **GREEDY)
        return prompt, "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=REQUEST_TIMEOUT_S) as aclient:
            return await asyncio.gather(*[stream_one(aclient, prompts[i % len(prompts)])
                                          for i in range(32)])

    results = asyncio.run(run_all())
    assert len(results) == 32
    for prompt, text in results:
        assert text == alone[prompt]


# ---- other endpoints ---------------------------------------------------------------------------

def test_models_tokenize_detokenize_version_health(server, tokenizer):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN

    ids = tokenizer(PROMPT).input_ids
    tok = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tok == {"tokens": ids, "count": len(ids), "max_model_len": MAX_MODEL_LEN}
    detok = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok == {"prompt": tokenizer.decode(ids)}
    assert detok["prompt"].endswith(PROMPT)
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] == _chat_prompt_len(tokenizer)

    assert httpx.get(server.url + "/version").json() == {"version": widellm.__version__}
    health = httpx.get(server.url + "/health")
    assert (health.status_code, health.content) == (200, b"")


def test_metrics_rise_by_the_request(server, client, tokenizer):
    before = metrics(server)
    _complete(client, max_tokens=5)
    after = metrics(server)
    delta = {name: metric(after, name) - metric(before, name) for name in [
        "widellm:generation_tokens_total", "widellm:prompt_tokens_total",
        "widellm:time_to_first_token_seconds_count", "widellm:e2e_request_latency_seconds_count"]}
    assert delta == {
        "widellm:generation_tokens_total": 5,
        "widellm:prompt_tokens_total": len(tokenizer(PROMPT).input_ids),
        "widellm:time_to_first_token_seconds_count": 1,
        "widellm:e2e_request_latency_seconds_count": 1,
    }
    success = "widellm:request_success_total"
    assert (metric(after, success, finished_reason="length")
            - metric(before, success, finished_reason="length")) == 1


BLOCK_SIZE = 16  # the engine's default block_size
HITS = "widellm:prefix_cache_hits_total"


def _hits_of(server, send) -> float:
    before = metric(metrics(server), HITS)
    send()
    return metric(metrics(server), HITS) - before


@pytest.mark.parametrize("value,status", [("0", 200), ("1", 400), ("-1", 400), ("r0", 400)])
def test_data_parallel_rank_header_pins_or_is_refused(server, value, status):
    """X-data-parallel-rank pins a request to a rank; this DP1 server has only rank 0, so
    every other value is a 400 naming the header (never silently ignored)."""
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(server.url + COMPLETIONS, json=body, timeout=REQUEST_TIMEOUT_S,
                   headers={DATA_PARALLEL_RANK_HEADER: value})
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json()["usage"]["completion_tokens"] == 2
    else:
        error = r.json()["error"]
        assert error["param"] == DATA_PARALLEL_RANK_HEADER
        assert error["message"].startswith(DATA_PARALLEL_RANK_HEADER + ": ")
        assert ("integer" if value == "r0" else "[0, 1)") in error["message"]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_cache_salt_separates_prefix_cache_hits(server, client, api):
    """Same salt: the second request reuses every full block but the one holding the last
    prompt token; another salt, or none, shares no block with it."""
    if api == "completions":
        prompt = [11] * (3 * BLOCK_SIZE + 1)  # sent by no other test: 3 full blocks and 1

        def send(salt: str | None) -> int:
            extra = {**IGNORE_EOS, **({} if salt is None else {"cache_salt": salt})}
            return client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=1,
                                             extra_body=extra, **GREEDY).usage.prompt_tokens
    else:
        messages = [{"role": "user", "content": "Salted: " + "tenant words " * 40}]

        def send(salt: str | None) -> int:
            extra = {**IGNORE_EOS, **({} if salt is None else {"cache_salt": salt})}
            return client.chat.completions.create(
                model=SERVED_NAME, messages=messages, max_tokens=1, extra_body=extra,
                **GREEDY).usage.prompt_tokens

    num_prompt = []
    assert _hits_of(server, lambda: num_prompt.append(send("tenant-a"))) == 0
    full_hit = (num_prompt[0] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert full_hit >= 3 * BLOCK_SIZE
    assert _hits_of(server, lambda: send("tenant-a")) == full_hit
    assert _hits_of(server, lambda: send("tenant-b")) == 0
    assert _hits_of(server, lambda: send(None)) == 0
    assert _hits_of(server, lambda: send(None)) == full_hit
    assert _hits_of(server, lambda: send("tenant-b")) == full_hit


# ---- bad input ---------------------------------------------------------------------------------

CHAT_OK = {"messages": MESSAGES}
BAD_REQUESTS = {
    "malformed json": (COMPLETIONS, b'{"prompt": "hi",', 400, None),
    "not an object": (COMPLETIONS, [1, 2], 400, None),
    "missing prompt": (COMPLETIONS, {"max_tokens": 4}, 400, "prompt"),
    "prompt of wrong type": (COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    "empty prompt": (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    "token outside vocab": (COMPLETIONS, {"prompt": [10**6]}, 400, "prompt"),
    "unknown model": (COMPLETIONS, {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    "max_tokens 0": (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    "too long": (COMPLETIONS, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    "temperature < 0": (COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    "top_p > 1": (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    "n over --max-n": (COMPLETIONS, {"prompt": "hi", "n": MAX_N + 1}, 400, "n"),
    "n 0": (COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n"),
    "logprobs over limit": (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    "empty stop string": (COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    "empty cache_salt": (COMPLETIONS, {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    "NaN temperature": (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400,
                        "temperature"),
    "Infinity penalty": (COMPLETIONS, b'{"prompt": "hi", "presence_penalty": -Infinity}', 400,
                         "presence_penalty"),
    "chat NaN top_p": (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"top_p": NaN}', 400, "top_p"),
    "seed over 64 bits": (COMPLETIONS, {"prompt": "hi", "seed": 2 ** 64}, 400, "seed"),
    "top_k over 64 bits": (COMPLETIONS, {"prompt": "hi", "top_k": 2 ** 70}, 400, "top_k"),
    "stop_token_ids over 64 bits": (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [2 ** 64]},
                                    400, "stop_token_ids"),
    "lone surrogate prompt": (COMPLETIONS, b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    "lone surrogate chat": (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                            400, "messages"),
    "chat empty cache_salt": (CHAT, {**CHAT_OK, "cache_salt": ""}, 400, "cache_salt"),
    "no messages": (CHAT, {"messages": []}, 400, "messages"),
    "chat max_completion_tokens 0": (CHAT, {**CHAT_OK, "max_completion_tokens": 0}, 400,
                                     "max_completion_tokens"),
    "chat too long": (CHAT, {**CHAT_OK, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    "top_logprobs without logprobs": (CHAT, {**CHAT_OK, "top_logprobs": 2}, 400, "top_logprobs"),
    "chat unknown model": (CHAT, {**CHAT_OK, "model": "gpt-9"}, 404, "model"),
    "detokenize wrong type": ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
}
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError"}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_openai_error_and_server_keeps_serving(server, case):
    path, body, status, param = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        response = httpx.post(server.url + path, content=body,
                              headers={"Content-Type": "application/json"})
    else:
        response = httpx.post(server.url + path, json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (ERROR_TYPES[status], param, status)
    assert error["message"]
    expected_words = {"too long": f"max_model_len={MAX_MODEL_LEN}",
                      "chat too long": f"max_model_len={MAX_MODEL_LEN}",
                      "malformed json": "malformed JSON", "not an object": "JSON object",
                      "n over --max-n": f"n must be <= {MAX_N}",
                      "temperature < 0": "temperature must be >= 0, got -1",
                      "NaN temperature": "temperature must be a finite number, got nan",
                      "seed over 64 bits": "seed must fit in a signed 64-bit integer",
                      "lone surrogate chat": "messages.0.content is not valid Unicode"}
    assert expected_words.get(case, "") in error["message"]
    good = httpx.post(server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2,
                                                      "ignore_eos": True},
                      timeout=REQUEST_TIMEOUT_S)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_openai_client_raises_the_matching_errors(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=4,
                                  temperature=-0.5)
    assert bad.value.status_code == 400
    assert "temperature must be >= 0" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)
    assert _complete(client, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_docs_are_open_without_an_api_key(server, path):
    """No --api-key: the docs answer anyone (the keyed server's guard is tested beside it)."""
    response = httpx.get(server.url + path)
    assert response.status_code == 200
    if path == "/openapi.json":
        assert "/v1/completions" in response.json()["paths"]
