"""Stall detection and abort counting through a live server.

The server runs with the test-only fault-injection hook WIDELLM_TEST_STEP_SLEEP_S, so every
model step sleeps STEP_SLEEP_S before its forward; with --request-stall-timeout-s well below
that, each token of a request comes after a stall the frontend must log (with the engine
core's state) and count. A client that disconnects is counted as
request_success_total{finished_reason="abort"}."""

from __future__ import annotations

import os
import re
from unittest import mock

import httpx
import pytest

from tests.e2e.server_harness import (
    PROMPT, ServerProcess, metric, metrics, raw_post, running, wait_until,
)

MODEL_ARCH = "LlamaForCausalLM"
STEP_SLEEP_S = 2.5
STALL_TIMEOUT_S = 1.0
MAX_TOKENS = 3
REQUEST_TIMEOUT_S = 120.0
WAIT_S = 60.0
STALL = re.compile(r"request (\S+) has had no token for ([\d.]+) s; (.*)")
CORE_STATE = re.compile(r"engine core 0: (\d+) steps, (\d+) running, (\d+) waiting, last step "
                        r"took ([\d.]+) s, last report ([\d.]+) s ago")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("stall") / "server.log"
    with mock.patch.dict(os.environ, {"WIDELLM_TEST_STEP_SLEEP_S": str(STEP_SLEEP_S)}):
        server = ServerProcess(model_dir(MODEL_ARCH), log, [
            "--served-model-name", "tiny", "--request-stall-timeout-s", str(STALL_TIMEOUT_S)])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_a_held_step_logs_a_stall_with_the_core_state_and_counts_it(server):
    before = metric(metrics(server), "widellm:request_stalls_total")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0.0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    # Every token waited one held step: one stall per token, each reported once.
    stalls = metric(metrics(server), "widellm:request_stalls_total", engine="0") - before
    assert stalls == MAX_TOKENS
    lines = [m for m in STALL.findall(server.log()) if m[0].startswith(r.json()["id"])]
    assert len(lines) == MAX_TOKENS, server.log()
    assert all(STALL_TIMEOUT_S <= float(idle) < STEP_SLEEP_S for _, idle, _ in lines)
    # Before the first token the core has not reported yet; then it reports after each step.
    states = [CORE_STATE.search(state) for _, _, state in lines]
    assert states[0] is None and "engine core 0 has sent no stats yet" in lines[0][2]
    for i, state in enumerate(states[1:], start=1):
        assert state is not None, lines[i]
        steps, num_running, waiting, last_step, since = state.groups()
        assert (int(steps), int(num_running), int(waiting)) == (i, 1, 0)
        assert float(last_step) >= STEP_SLEEP_S
        assert STALL_TIMEOUT_S <= float(since) < STEP_SLEEP_S


@pytest.mark.timeout(300)
def test_a_client_disconnect_counts_as_an_abort(server):
    def aborts() -> float:
        return metric(metrics(server), "widellm:request_success_total",
                      finished_reason="abort")

    before = aborts()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 50, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    sock = raw_post(server, body)
    try:
        wait_until(lambda: running(server) == 1, WAIT_S, "the request to run")
    finally:
        sock.close()
    wait_until(lambda: aborts() == before + 1, WAIT_S, "the abort to be counted")
    wait_until(lambda: running(server) == 0, WAIT_S, "the request to leave the batch")
    assert aborts() == before + 1
