"""Disaggregated prefill/decode deployments for the e2e tests: ``widellm serve`` instances
with a KV connector and ``widellm proxy`` in front, each its own process group that the
fixtures stop even when a test fails."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.e2e.server_harness import POLL_S, REQUEST_TIMEOUT_S, ServerProcess, metric, metrics


def kv_flags(role: str, policy: str = "recompute", **extra) -> list[str]:
    config = {"kv_connector": "TCPConnector", "kv_role": role, "kv_load_failure_policy": policy,
              "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config)]


class ProxyProcess(ServerProcess):
    """``widellm proxy`` in its own session, logging to a file (started like a server)."""

    def __init__(self, prefill: list[str], decode: list[str], log_path: Path,
                 extra_args: list[str] = ()) -> None:
        self.port, self.url, self.log_path = 0, "", log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "widellm.entrypoints.cli", "proxy", "--port", "0",
             "--prefill", *prefill, "--decode", *decode, *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ))


@contextlib.contextmanager
def started(*procs: ServerProcess):
    """Wait for every process to be healthy; stop them all on the way out."""
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:  # all told at once: each drains on its own (suite time)
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in procs:
            p.stop()


def kv_usage(server: ServerProcess) -> float:
    return metric(metrics(server), "widellm:kv_cache_usage_perc")


def wait_for_metric(server: ServerProcess, name: str, want, timeout_s: float = 15.0,
                    **labels) -> float:
    """Poll ``server``'s /metrics until ``want(value)`` holds; returns the value."""
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = metric(metrics(server), name, **labels)
        if want(value):
            return value
        time.sleep(POLL_S)
    raise AssertionError(f"{name}{labels} = {value} after {timeout_s} s")


def prefill(server: ServerProcess, prompt: list[int], **body) -> dict:
    """What the proxy asks a prefill instance: the prompt, one token, its KV kept for us."""
    r = httpx.post(server.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": {"do_remote_decode": True}, **body})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["num_prompt_tokens"] == len(prompt)
    return params


def decode(server: ServerProcess, prompt: list[int], params: dict, max_tokens: int
           ) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": params})
