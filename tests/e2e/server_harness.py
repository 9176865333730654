"""``widellm serve`` as a user runs it, for the e2e tests: a server subprocess in its own
session on a tiny random model (stopped with everything it spawned, even when a test fails),
and readers of its Prometheus metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL_ARCH = "LlamaForCausalLM"
SERVED_NAME = "tiny-llama"
MAX_MODEL_LEN = 512
MAX_N = 4
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256",
                "--max-model-len", str(MAX_MODEL_LEN)]
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0
REQUEST_TIMEOUT_S = 60.0
POLL_S = 0.1
PROMPT = "The capital of France is"

# The server's start-up line: "widellm X serving MODEL at http://127.0.0.1:PORT (OpenAI ...".
BOUND_URL = re.compile(r"http://127\.0\.0\.1:(\d+)(?= \(OpenAI)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
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

    # The start-up line's address (a TLS server's subclass reads its https:// one).
    bound_url = BOUND_URL

    def healthy(self) -> bool:
        """``/health`` answers 200 (raises httpx.TransportError while nothing listens)."""
        return httpx.get(self.url + "/health", timeout=1.0).status_code == 200

    def wait_ready(self) -> None:
        """Wait for the log line with the bound address, then for ``/health`` to answer 200."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited at start-up:\n{self.log()}"
            if not self.url and (bound := self.bound_url.search(self.log())):
                self.url, self.port = bound.group(0), int(bound.group(1))
            try:
                if self.url and self.healthy():
                    return
            except httpx.TransportError:
                pass
            time.sleep(POLL_S * 2)
        raise AssertionError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def engine_core_pid(self) -> int:
        cores = [c for c in children(self.proc.pid)
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


def start_server(model_dir, tmp_path_factory, name: str, extra_args: list[str],
                 env: dict[str, str] | None = None):
    """A module fixture's body: a started server on the tiny model, stopped afterwards."""
    server = ServerProcess(model_dir(MODEL_ARCH), tmp_path_factory.mktemp(name) / "server.log",
                           extra_args, env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def metrics(server) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(server.url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            values[(s.name, labels)] = s.value
    return values


def metric(values, name: str, **labels) -> float:
    """Sum over the samples of ``name`` carrying ``labels`` (and any others, e.g. rank)."""
    want = frozenset(labels.items())
    return sum(v for (n, have), v in values.items() if n == name and want <= have)


def total_successes(values) -> float:
    """Requests finished successfully, over every label (``values`` from :func:`metrics`)."""
    return sum(v for (name, _), v in values.items() if name == "widellm:request_success_total")


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(POLL_S)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def idle(server) -> bool:
    m = metrics(server)
    return (metric(m, "widellm:num_requests_running") == 0
            and metric(m, "widellm:kv_cache_usage_perc") == 0)


def running(server) -> float:
    return metric(metrics(server), "widellm:num_requests_running")



def raw_post(server, body: dict, api_key: str | None = None) -> socket.socket:
    """Send a completion request on a bare socket; the caller closes it without reading a
    byte (a client that leaves)."""
    payload = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n" + auth
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock
