"""SIGTERM under load: ``widellm serve`` stops accepting, lets running requests finish within
``--shutdown-timeout``, ends the rest with an OpenAI-style error (an error event and
``[DONE]`` on a stream, a JSON 503 otherwise), and exits 0 with no process left."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
import pytest

from tests.e2e.server_harness import (
    MODEL_ARCH, REQUEST_TIMEOUT_S, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S, ServerProcess, children,
    running, wait_until,
)
from tests.e2e.test_process_lifecycle import _wait_gone
from widellm.worker.model_runner import TEST_STEP_SLEEP_ENV

pytestmark = pytest.mark.timeout(STARTUP_TIMEOUT_S + 120)

NUM_STREAMS = 4
NUM_PLAIN = 2
# Finishes within the long drain; still generating when the short one ends.
MAX_TOKENS = 300
LONG_DRAIN_S = 60.0
SHORT_DRAIN_S = 0.5
# Steps slowed by the runner's test hook, so 300 tokens take >= 3 s: past the short drain,
# and long enough that every request is seen running before the SIGTERM.
STEP_SLEEP_S = 0.01
POLL_S = 0.02


def _body(stream: bool) -> dict:
    return {"prompt": [5, 6, 7], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": stream}


def _stream(url: str, started: concurrent.futures.Future | None) -> list[dict | str]:
    """The SSE events of one streamed completion, decoded; ``[DONE]`` as the string."""
    events: list[dict | str] = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        with http.stream("POST", url + "/v1/completions", json=_body(True)) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if started is not None and not started.done():
                    started.set_result(True)
    return events


def _plain(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=_body(False), timeout=REQUEST_TIMEOUT_S)


def _sigterm_under_load(server: ServerProcess):
    """Start the streams and plain requests, SIGTERM the server once every stream has its
    first chunk and every request is running (a plain request still connecting would be
    refused, not drained); returns (stream events per stream, plain responses, exit code,
    core pids)."""
    server.wait_ready()
    cores = children(server.proc.pid)  # the engine core and any helper
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS + NUM_PLAIN) as pool:
        started = [concurrent.futures.Future() for _ in range(NUM_STREAMS)]
        streams = [pool.submit(_stream, server.url, f) for f in started]
        plain = [pool.submit(_plain, server.url) for _ in range(NUM_PLAIN)]
        concurrent.futures.wait(started, timeout=REQUEST_TIMEOUT_S)
        assert all(f.done() for f in started)
        wait_until(lambda: running(server) == NUM_STREAMS + NUM_PLAIN, REQUEST_TIMEOUT_S,
                   "every request to run")
        server.proc.send_signal(signal.SIGTERM)
        events = [f.result() for f in streams]
        responses = [f.result() for f in plain]
    code = server.proc.wait(STOP_TIMEOUT_S + LONG_DRAIN_S)
    return events, responses, code, cores


def _serve(model_dir, tmp_path, drain_s: float) -> ServerProcess:
    return ServerProcess(model_dir(MODEL_ARCH), tmp_path / "server.log",
                         ["--shutdown-timeout", str(drain_s)])


def test_sigterm_lets_running_requests_finish(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(TEST_STEP_SLEEP_ENV, str(STEP_SLEEP_S))
    server = _serve(model_dir, tmp_path, LONG_DRAIN_S)
    try:
        events, responses, code, cores = _sigterm_under_load(server)
        for stream in events:
            assert stream[-1] == "[DONE]"
            finals = [e["choices"][0]["finish_reason"] for e in stream[:-1]]
            assert finals[-1] == "length" and finals.count("length") == 1
            assert all("error" not in e for e in stream[:-1])
        for r in responses:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        assert code == 0
        assert _wait_gone(cores, STOP_TIMEOUT_S) == []
        log = server.log()
        assert "Traceback" not in log
        assert "drain timeout" not in log
    finally:
        server.stop()


def test_sigterm_past_the_drain_timeout_ends_requests_with_errors(model_dir, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv(TEST_STEP_SLEEP_ENV, str(STEP_SLEEP_S))
    server = _serve(model_dir, tmp_path, SHORT_DRAIN_S)
    try:
        events, responses, code, cores = _sigterm_under_load(server)
        for stream in events:
            assert stream[-1] == "[DONE]"
            error = stream[-2]["error"]
            assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
            assert f"--shutdown-timeout {SHORT_DRAIN_S:g} s" in error["message"]
            # Cut part-way: some text came, not all of it.
            assert all("choices" in e for e in stream[:-2])
            assert 0 < len(stream) - 2 < MAX_TOKENS
        for r in responses:
            assert r.status_code == 503, r.text
            assert r.headers["content-type"] == "application/json"
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
        assert code == 0
        assert _wait_gone(cores, STOP_TIMEOUT_S) == []
        log = server.log()
        assert "Traceback" not in log
        assert f"ended {NUM_STREAMS + NUM_PLAIN} running request(s)" in log
    finally:
        server.stop()


def test_no_new_connections_while_draining(model_dir, tmp_path):
    server = _serve(model_dir, tmp_path, LONG_DRAIN_S)
    try:
        server.wait_ready()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started: concurrent.futures.Future = concurrent.futures.Future()
            stream = pool.submit(_stream, server.url, started)
            started.result(REQUEST_TIMEOUT_S)
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            refused = False
            while not refused and time.monotonic() < deadline:
                try:
                    httpx.get(server.url + "/health", timeout=1.0)
                    time.sleep(POLL_S)
                except httpx.ConnectError:
                    refused = True
            assert refused
            assert stream.result()[-1] == "[DONE]"
        assert server.proc.wait(STOP_TIMEOUT_S) == 0
    finally:
        server.stop()
