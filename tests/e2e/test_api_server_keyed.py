"""``widellm serve`` behind --api-key, on a second server whose steps are slowed: requests cut
off by a disconnect are aborted, the key guards every route but /health, the logged curl hint
works, and a killed engine core fails its requests and /health at once. (The unkeyed server's
API is tested in ``test_api_server.py``.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.server_harness import (
    ENGINE_FLAGS, MODEL_ARCH, PROMPT, REQUEST_TIMEOUT_S, SERVED_NAME, STARTUP_TIMEOUT_S, idle,
    metric, metrics, raw_post, running, start_server, total_successes, wait_until,
)
from widellm.worker.model_runner import TEST_STEP_SLEEP_ENV

API_KEY = "test-secret"
IDLE_TIMEOUT_S = 20.0
DEATH_TIMEOUT_S = 10.0
# Long enough that a request is still generating when the test cuts it off.
LONG_MAX_TOKENS = 400
KEYED_STEP_SLEEP_S = 0.02  # 400 slowed steps take 8 s, far longer than the death test waits
IGNORE_EOS = {"ignore_eos": True}  # fixed output lengths from a random model
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def keyed_server(model_dir, tmp_path_factory):
    """A second instance behind --api-key; the engine-death test kills its core. Its steps are
    slowed (test-only hook) so that the death and disconnect tests' requests are surely still
    running when the core dies or the client leaves: unslowed, the tiny model finishes 400
    tokens in well under a second."""
    yield from start_server(model_dir, tmp_path_factory, "keyed",
                            ["--api-key", API_KEY, "--served-model-name", SERVED_NAME],
                            {TEST_STEP_SLEEP_ENV: str(KEYED_STEP_SLEEP_S)})


# ---- disconnects ------------------------------------------------------------------------------

def _long_request(stream: bool) -> dict:
    return {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": LONG_MAX_TOKENS,
            "ignore_eos": True, "temperature": 0.0, "stream": stream}


def _assert_aborted(server, before, aborts=(1,)) -> None:
    """Back to idle (no running request, no KV block in use) with no request finishing, and
    the abort counted as request_success_total{finished_reason="abort"} (``aborts``: the
    allowed increments; a request cut before it reached the engine is not counted)."""
    wait_until(lambda: idle(server), IDLE_TIMEOUT_S, "running requests and KV usage to drop")
    after = metrics(server)
    aborted = (metric(after, "widellm:request_success_total", finished_reason="abort")
               - metric(before, "widellm:request_success_total", finished_reason="abort"))
    assert aborted in aborts
    assert total_successes(after) - aborted == total_successes(before)
    generated = (metric(after, "widellm:generation_tokens_total")
                 - metric(before, "widellm:generation_tokens_total"))
    assert generated < LONG_MAX_TOKENS


# The disconnect tests run on the keyed server, whose steps are slowed: unslowed, the request
# can finish all its tokens before the test sees it running or cuts it off.

def test_disconnect_mid_stream_aborts_the_request(keyed_server):
    server = keyed_server
    before = metrics(server)
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
    before = metrics(server)
    sock = raw_post(server, _long_request(stream), API_KEY)
    try:
        wait_until(lambda: running(server) == 1, IDLE_TIMEOUT_S, "the request to run")
    finally:
        sock.close()
    _assert_aborted(server, before)


def test_disconnect_right_after_sending_leaves_nothing_running(keyed_server):
    server = keyed_server
    before = metrics(server)
    raw_post(server, _long_request(True), API_KEY).close()
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
def test_docs_follow_the_api_key(keyed_server, path):
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
            wait_until(lambda: running(keyed_server) == 2, IDLE_TIMEOUT_S, "both requests")
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
