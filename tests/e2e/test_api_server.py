"""The OpenAI-compatible server run as a user runs it: ``widellm serve`` in a subprocess on a
tiny random model, driven by the official ``openai`` client (the API oracle) and raw httpx for
what the client hides (status codes, error bodies, SSE frames, disconnects)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import widellm
from widellm.engine.tokenizer import get_tokenizer
from widellm.entrypoints.serving_base import DATA_PARALLEL_RANK_HEADER
from widellm.worker.model_runner import TEST_STEP_SLEEP_ENV

MODEL_ARCH = "LlamaForCausalLM"
SERVED_NAME = "tiny-llama"
MAX_MODEL_LEN = 512
MAX_N = 4
API_KEY = "test-secret"
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256",
                "--max-model-len", str(MAX_MODEL_LEN)]
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0
REQUEST_TIMEOUT_S = 60.0
IDLE_TIMEOUT_S = 20.0
DEATH_TIMEOUT_S = 10.0
POLL_S = 0.1
# Long enough that a request is still generating when the test cuts it off.
LONG_MAX_TOKENS = 400
KEYED_STEP_SLEEP_S = 0.02  # 400 slowed steps take 8 s, far longer than the death test waits
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0}
IGNORE_EOS = {"ignore_eos": True}  # fixed output lengths from a random model


# The server's start-up line: "widellm X serving MODEL at http://127.0.0.1:PORT (OpenAI ...".
BOUND_URL = re.compile(r"http://127\.0\.0\.1:(\d+)(?= \(OpenAI)")


# ---- the server process ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


class ServerProcess:
    """``python -m widellm.entrypoints.cli serve`` in its own session (so the engine core it
    spawns can be killed with it), logging to a file."""

    def __init__(self, model: str, log_path: Path, extra_args: list[str],
                 env: dict[str, str] | None = None) -> None:
        # Port 0: the server binds a free port itself and logs it, so no other process can
        # take the port between choosing and binding it. ``wait_ready`` sets the real ones.
        self.port = 0
        self.url = ""
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "widellm.entrypoints.cli", "serve", model,
             "--port", "0", "--max-n", str(MAX_N), "--disable-uvicorn-access-log",
             *ENGINE_FLAGS, *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        """Wait for the log line with the bound address, then for ``/health`` to answer 200."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited at start-up:\n{self.log()}"
            if not self.url and (bound := BOUND_URL.search(self.log())):
                self.url, self.port = bound.group(0), int(bound.group(1))
            try:
                if self.url and httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(POLL_S * 2)
        raise AssertionError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def engine_core_pid(self) -> int:
        cores = [c for c in _children(self.proc.pid)
                 if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(cores) == 1, cores
        return cores[0]

    def stop(self) -> None:
        """SIGTERM the server (it stops its engine core), then SIGKILL whatever is left of
        the process group."""
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(STOP_TIMEOUT_S)
        self._log.close()


def _start(model_dir, tmp_path_factory, name: str, extra_args: list[str],
           env: dict[str, str] | None = None):
    server = ServerProcess(model_dir(MODEL_ARCH), tmp_path_factory.mktemp(name) / "server.log",
                           extra_args, env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from _start(model_dir, tmp_path_factory, "server", ["--served-model-name", SERVED_NAME])


@pytest.fixture(scope="module")
def keyed_server(model_dir, tmp_path_factory):
    """A second instance behind --api-key; the engine-death test kills its core. Its steps are
    slowed (test-only hook) so that the death and disconnect tests' requests are surely still
    running when the core dies or the client leaves: unslowed, the tiny model finishes 400
    tokens in well under a second."""
    yield from _start(model_dir, tmp_path_factory, "keyed",
                      ["--api-key", API_KEY, "--served-model-name", SERVED_NAME],
                      {TEST_STEP_SLEEP_ENV: str(KEYED_STEP_SLEEP_S)})


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

def _metrics(server) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(server.url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            values[(s.name, labels)] = s.value
    return values


def _metric(values, name: str, **labels) -> float:
    """Sum over the samples of ``name`` carrying ``labels`` (and any others, e.g. rank)."""
    want = frozenset(labels.items())
    return sum(v for (n, have), v in values.items() if n == name and want <= have)


def _total_successes(values) -> float:
    return sum(v for (name, _), v in values.items() if name == "widellm:request_success_total")


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(POLL_S)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _idle(server) -> bool:
    m = _metrics(server)
    return (_metric(m, "widellm:num_requests_running") == 0
            and _metric(m, "widellm:kv_cache_usage_perc") == 0)


def _running(server) -> float:
    return _metric(_metrics(server), "widellm:num_requests_running")


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
    before = _metrics(server)
    _complete(client, max_tokens=5)
    after = _metrics(server)
    delta = {name: _metric(after, name) - _metric(before, name) for name in [
        "widellm:generation_tokens_total", "widellm:prompt_tokens_total",
        "widellm:time_to_first_token_seconds_count", "widellm:e2e_request_latency_seconds_count"]}
    assert delta == {
        "widellm:generation_tokens_total": 5,
        "widellm:prompt_tokens_total": len(tokenizer(PROMPT).input_ids),
        "widellm:time_to_first_token_seconds_count": 1,
        "widellm:e2e_request_latency_seconds_count": 1,
    }
    success = "widellm:request_success_total"
    assert (_metric(after, success, finished_reason="length")
            - _metric(before, success, finished_reason="length")) == 1


BLOCK_SIZE = 16  # the engine's default block_size
HITS = "widellm:prefix_cache_hits_total"


def _hits_of(server, send) -> float:
    before = _metric(_metrics(server), HITS)
    send()
    return _metric(_metrics(server), HITS) - before


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

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
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


# ---- disconnects ------------------------------------------------------------------------------

def _long_request(stream: bool) -> dict:
    return {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": LONG_MAX_TOKENS,
            "ignore_eos": True, "temperature": 0.0, "stream": stream}


def _raw_post(server, body: dict) -> socket.socket:
    """Send a request on a bare socket (with the keyed server's key); the caller closes it
    without reading a byte."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\n".encode()
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def _assert_aborted(server, before, aborts=(1,)) -> None:
    """Back to idle (no running request, no KV block in use) with no request finishing, and
    the abort counted as request_success_total{finished_reason="abort"} (``aborts``: the
    allowed increments; a request cut before it reached the engine is not counted)."""
    _wait_until(lambda: _idle(server), IDLE_TIMEOUT_S, "running requests and KV usage to drop")
    after = _metrics(server)
    aborted = (_metric(after, "widellm:request_success_total", finished_reason="abort")
               - _metric(before, "widellm:request_success_total", finished_reason="abort"))
    assert aborted in aborts
    assert _total_successes(after) - aborted == _total_successes(before)
    generated = (_metric(after, "widellm:generation_tokens_total")
                 - _metric(before, "widellm:generation_tokens_total"))
    assert generated < LONG_MAX_TOKENS


# The disconnect tests run on the keyed server, whose steps are slowed: unslowed, the request
# can finish all its tokens before the test sees it running or cuts it off.

def test_disconnect_mid_stream_aborts_the_request(keyed_server):
    server = keyed_server
    before = _metrics(server)
    with httpx.Client(timeout=REQUEST_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        with http.stream("POST", server.url + COMPLETIONS, json=_long_request(True)) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            data = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
            assert len(data) == 3
    _assert_aborted(server, before)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_generating_aborts_the_request(keyed_server, stream):
    server = keyed_server
    before = _metrics(server)
    sock = _raw_post(server, _long_request(stream))
    try:
        _wait_until(lambda: _running(server) == 1, IDLE_TIMEOUT_S, "the request to run")
    finally:
        sock.close()
    _assert_aborted(server, before)


def test_disconnect_right_after_sending_leaves_nothing_running(keyed_server):
    server = keyed_server
    before = _metrics(server)
    _raw_post(server, _long_request(True)).close()
    _assert_aborted(server, before, aborts=(0, 1))


# ---- API key and engine death (second server) ----------------------------------------------

def test_api_key_is_required_when_set(keyed_server):
    url = keyed_server.url + "/v1/models"
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}]:
        response = httpx.get(url, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(keyed_server.url + "/health").status_code == 200  # probes need no key

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="wrong",
                      max_retries=0).models.list()
    keyed = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=API_KEY, max_retries=0,
                          timeout=REQUEST_TIMEOUT_S)
    model = keyed.models.list().data[0].id
    out = keyed.completions.create(model=model, prompt=PROMPT, max_tokens=3,
                                   extra_body=IGNORE_EOS)
    assert out.usage.completion_tokens == 3


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_docs_follow_the_api_key(server, keyed_server, path):
    assert httpx.get(server.url + path).status_code == 200  # no key set: open
    response = httpx.get(keyed_server.url + path)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "AuthenticationError"
    keyed = httpx.get(keyed_server.url + path, headers={"Authorization": f"Bearer {API_KEY}"})
    assert keyed.status_code == 200
    if path == "/openapi.json":
        assert "/v1/completions" in keyed.json()["paths"]
    else:
        assert "/openapi.json" in keyed.text  # the page loads the guarded schema


def test_logged_curl_command_works_with_the_exported_key(keyed_server):
    """The start-up log's curl hint, run by a shell with WIDELLM_API_KEY exported, gets an
    answer (the key used to sit in single quotes, so the shell sent it unexpanded: 401)."""
    lines = [line.strip() for line in keyed_server.log().splitlines()
             if line.strip().startswith("curl ")]
    assert len(lines) == 1, keyed_server.log()
    assert "$WIDELLM_API_KEY" in lines[0]
    done = subprocess.run(["bash", "-c", lines[0] + " -sS --fail-with-body"],
                          env={**os.environ, "WIDELLM_API_KEY": API_KEY},
                          capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S)
    assert done.returncode == 0, done.stderr + done.stdout
    assert json.loads(done.stdout)["usage"]["completion_tokens"] >= 1


def test_engine_core_death_fails_requests_and_health(keyed_server):
    url = keyed_server.url
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {**_long_request(True), "model": None}
    blocking: dict = {}

    def non_streaming():
        blocking["response"] = httpx.post(url + COMPLETIONS, headers=headers,
                                          json={**body, "stream": False},
                                          timeout=REQUEST_TIMEOUT_S)

    # Both requests go out together: a tiny model generates its 400 tokens in about a second,
    # so a second request sent only after the first streamed a chunk could find it finished.
    waiter = threading.Thread(target=non_streaming)
    waiter.start()
    with httpx.Client(timeout=DEATH_TIMEOUT_S, headers=headers) as http:
        with http.stream("POST", url + COMPLETIONS, json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            _wait_until(lambda: _running(keyed_server) == 2, IDLE_TIMEOUT_S, "both requests")
            os.kill(keyed_server.engine_core_pid(), signal.SIGKILL)
            killed = time.monotonic()
            rest = [line for line in lines if line.startswith("data:")]
    assert time.monotonic() - killed < DEATH_TIMEOUT_S
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data:"):])["error"]
    assert (error["type"], error["code"]) == ("InternalServerError", 500)
    assert "engine" in error["message"]

    waiter.join(DEATH_TIMEOUT_S)
    assert blocking["response"].status_code == 500
    assert blocking["response"].json()["error"]["type"] == "InternalServerError"

    health = httpx.get(url + "/health")
    assert health.status_code == 503
    assert health.json()["error"]["type"] == "ServiceUnavailableError"
    after = httpx.post(url + COMPLETIONS, headers=headers, json={"prompt": "hi"})
    assert after.status_code == 500 and "engine" in after.json()["error"]["message"]
    assert "failing" in keyed_server.log()  # the server said why


def test_taken_port_fails_before_the_model_loads(model_dir, tmp_path):
    """The HTTP port is bound before the engine core starts: a taken port ends the server at
    once (exit 1, saying why) instead of after loading the model."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "widellm.entrypoints.cli", "serve", model_dir(MODEL_ARCH),
             "--port", str(port), *ENGINE_FLAGS],
            capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S,
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "KV cache" not in result.stderr  # no engine core was started
