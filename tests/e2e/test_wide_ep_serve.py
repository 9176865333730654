"""Wide expert parallelism through ``widellm serve`` with the ``openai`` client: two ranks
with experts split over them, a two-"node" launch (API server with ranks 0-1 plus a
``--headless`` process with ranks 2-3, meeting over TCP), per-rank metrics, and a rank that
crashes making the server unhealthy and failing in-flight requests instead of hanging."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server_harness import (
    ENGINE_FLAGS, REQUEST_TIMEOUT_S, STOP_TIMEOUT_S, ServerProcess, children, free_port, metric,
    metrics,
)
from widellm import LLM, SamplingParams

ARCH = "DeepseekV3ForCausalLM"
NUM_REQUESTS = 16
MAX_TOKENS = 12
EP_FLAGS = ["--enable-expert-parallel", "--all2all-backend", "all2all"]
DEATH_TIMEOUT_S = 15.0
# Dual-batch overlap on every step that has two tokens or more on each rank.
DBO_FLAGS = ["--enable-dbo", "--dbo-decode-token-threshold", "2",
             "--dbo-prefill-token-threshold", "2"]


def _prompts() -> list[list[int]]:
    # Token ids of very different lengths (4..154), so ranks finish at different steps.
    return [[3 + (7 * i + j) % 250 for j in range(4 + 10 * i)] for i in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def expected(model_dir) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model_dir(ARCH), dtype="float32", num_kv_blocks=256) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params,
                            use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _concurrent_completions(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S)

    def one(prompt: list[int]) -> str:
        stream = client.completions.create(model=client.models.list().data[0].id,
                                           prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
        return list(pool.map(one, _prompts()))


def _rank_samples(server: ServerProcess, name: str) -> dict[str, float]:
    return {dict(labels)["engine"]: v for (n, labels), v in metrics(server).items()
            if n == name and "engine" in dict(labels)}


def _engine_core_pids(server: ServerProcess) -> list[int]:
    return [c for c in children(server.proc.pid)
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.fixture(scope="module")
def dp2_server(model_dir, tmp_path_factory):
    server = ServerProcess(model_dir(ARCH), tmp_path_factory.mktemp("dp2") / "server.log",
                           ["--data-parallel-size", "2", *EP_FLAGS, "--async-scheduling",
                            *DBO_FLAGS])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_dp2_ep_serve_equals_single_rank(dp2_server, expected):
    assert _concurrent_completions(dp2_server.url) == expected
    # Both ranks took requests, report with an engine label, and are idle again.
    finished = _rank_samples(dp2_server, "widellm:prefix_cache_queries_total")
    assert sorted(finished) == ["0", "1"] and all(v > 0 for v in finished.values())
    usage = _rank_samples(dp2_server, "widellm:kv_cache_usage_perc")
    assert usage == {"0": 0.0, "1": 0.0}
    dbo = _rank_samples(dp2_server, "widellm:dbo_steps_total")
    assert sorted(dbo) == ["0", "1"] and all(v > 0 for v in dbo.values()), dbo


def test_disconnect_frees_the_rank_that_held_the_request(dp2_server):
    """A client that goes away mid-stream: the abort reaches the rank holding the request
    and its KV blocks come back, on every rank."""
    body = {"prompt": [7] * 40, "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0}
    before = metrics(dp2_server)
    for _ in range(2):  # the balancer puts the two on different ranks
        with httpx.stream("POST", dp2_server.url + "/v1/completions", json=body,
                          timeout=REQUEST_TIMEOUT_S) as response:
            assert next(response.iter_lines()).startswith("data: {")
    deadline = time.monotonic() + DEATH_TIMEOUT_S
    while time.monotonic() < deadline:
        usage = _rank_samples(dp2_server, "widellm:kv_cache_usage_perc")
        running = _rank_samples(dp2_server, "widellm:num_requests_running")
        if set(usage.values()) == {0.0} and set(running.values()) == {0.0}:
            break
        time.sleep(0.1)
    assert set(usage.values()) == {0.0} and set(running.values()) == {0.0}, (usage, running)
    after = metrics(dp2_server)
    # Neither request ran to its end: both were cut short by the abort, and counted so.
    successes = "widellm:request_success_total"
    delta = {reason: metric(after, successes, finished_reason=reason)
             - metric(before, successes, finished_reason=reason)
             for reason in ("stop", "length", "abort")}
    assert delta == {"stop": 0, "length": 0, "abort": 2}
    generated = "widellm:generation_tokens_total"
    assert metric(after, generated) - metric(before, generated) < 2 * body["max_tokens"]


def test_two_node_launch_equals_single_rank(model_dir, tmp_path, expected):
    rpc_port = free_port()
    common = ["--data-parallel-size", "4", "--data-parallel-size-local", "2",
              "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
              *EP_FLAGS]
    head = ServerProcess(model_dir(ARCH), tmp_path / "head.log", common)
    log = open(tmp_path / "headless.log", "wb")
    headless = subprocess.Popen(
        [sys.executable, "-m", "widellm.entrypoints.cli", "serve", model_dir(ARCH), "--headless",
         "--data-parallel-start-rank", "2", *ENGINE_FLAGS, *common],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        head.wait_ready()
        assert _concurrent_completions(head.url) == expected
        assert sorted(_rank_samples(head, "widellm:kv_cache_usage_perc")) == ["0", "1", "2", "3"]
        head.stop()
        # The head's shutdown reaches the remote ranks; the headless launcher then exits.
        assert headless.wait(STOP_TIMEOUT_S * 2) == 0
    finally:
        head.stop()
        if headless.poll() is None:
            os.killpg(headless.pid, signal.SIGKILL)
            headless.wait(STOP_TIMEOUT_S)
        log.close()


def test_rank_crash_fails_requests_and_health(dp2_server):
    """Runs last on its server: kills rank 1 while a long request streams."""
    url = dp2_server.url
    body = {"prompt": [5] * 8, "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.Client(timeout=DEATH_TIMEOUT_S) as http:
        with http.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            cores = _engine_core_pids(dp2_server)
            assert len(cores) == 2
            killed_pid = max(cores)
            os.kill(killed_pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = [line for line in lines if line.startswith("data:")]
    assert time.monotonic() - killed < DEATH_TIMEOUT_S
    assert rest[-1] == "data: [DONE]"
    # The dead rank is named (not the survivor whose collective failed), by its signal.
    message = json.loads(rest[-2].removeprefix("data: "))["error"]["message"]
    assert re.search(rf"engine core [01] \(pid {killed_pid}\) died: killed by SIGKILL", message), \
        message
    assert httpx.get(url + "/health").status_code == 503
    # Both cores are reaped (gone from /proc, not zombies) while the server lives on.
    deadline = time.monotonic() + DEATH_TIMEOUT_S
    while any(Path(f"/proc/{pid}").exists() for pid in cores) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in cores if Path(f"/proc/{pid}").exists()] == []
