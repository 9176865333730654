"""Engine-core processes and their server's life: a server that is PID 1 (a container), a
server adopted by a subreaper, and a core killed during start-up."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_harness import (
    ENGINE_FLAGS, MAX_N, MODEL_ARCH, REQUEST_TIMEOUT_S, STARTUP_TIMEOUT_S, ServerProcess,
    children,
)

pytestmark = pytest.mark.timeout(STARTUP_TIMEOUT_S + 120)

# Orphaned cores see their parent's death at once (PDEATHSIG) or within one idle poll (1 s).
CORE_EXIT_TIMEOUT_S = 15.0
POLL_S = 0.05
PR_SET_CHILD_SUBREAPER = 36
# Run as a subreaper: adopts (and reaps) the server's orphans; exits when no child is left.
SUBREAPER = f"""
import ctypes, os, subprocess, sys
ctypes.CDLL(None).prctl({PR_SET_CHILD_SUBREAPER}, 1, 0, 0, 0)
subprocess.Popen(sys.argv[1:])
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def _serve_cmd(model: str) -> list[str]:
    return [sys.executable, "-m", "widellm.entrypoints.cli", "serve", model, "--port", "0",
            "--max-n", str(MAX_N), "--disable-uvicorn-access-log", *ENGINE_FLAGS]


class WrappedServer(ServerProcess):
    """``widellm serve`` under a launcher (``unshare``, a subreaper): ``self.proc`` is the
    launcher, ``server_pid`` the server it started."""

    def __init__(self, model: str, log_path: Path, launcher: list[str]) -> None:
        self.port, self.url, self.log_path = 0, "", log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([*launcher, *_serve_cmd(model)], stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def server_pid(self) -> int:
        (pid,) = children(self.proc.pid)
        return pid

    def core_pids(self) -> list[int]:
        return [c for c in children(self.server_pid())
                if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _can_unshare_pid() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*UNSHARE, "true"], capture_output=True).returncode == 0


def _alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(POLL_S)
    return [p for p in pids if _alive(p)]


def _complete(server) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
        "model": server.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def _start_wrapped(model_dir, tmp_path, launcher) -> WrappedServer:
    server = WrappedServer(model_dir(MODEL_ARCH), tmp_path / "server.log", launcher)
    server.model = model_dir(MODEL_ARCH)
    return server


def test_server_as_pid_1_serves_and_its_cores_die_with_it(model_dir, tmp_path):
    if not _can_unshare_pid():
        pytest.skip("cannot create a PID namespace here (unshare --pid --fork --mount-proc)")
    server = _start_wrapped(model_dir, tmp_path, UNSHARE)
    try:
        server.wait_ready()
        pid = server.server_pid()
        nspid = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if ln.startswith("NSpid:")).split()
        assert nspid[-1] == "1", nspid  # the server is PID 1 of its namespace
        _complete(server)  # the old "parent pid is 1 => orphaned" check made cores quit here
        cores = server.core_pids()
        assert len(cores) == 1
        os.kill(pid, signal.SIGKILL)
        assert _wait_gone([pid, *cores], CORE_EXIT_TIMEOUT_S) == []
    finally:
        server.stop()


def test_cores_of_a_killed_server_exit_under_a_subreaper(model_dir, tmp_path):
    """A subreaper (not init) adopts the orphaned core: it must still notice and exit."""
    server = _start_wrapped(model_dir, tmp_path, [sys.executable, "-c", SUBREAPER])
    try:
        server.wait_ready()
        _complete(server)
        pid, cores = server.server_pid(), server.core_pids()
        assert len(cores) == 1
        os.kill(pid, signal.SIGKILL)
        assert _wait_gone([pid, *cores], CORE_EXIT_TIMEOUT_S) == []
        # The subreaper exits once it has reaped everything: no process is left.
        assert server.proc.wait(CORE_EXIT_TIMEOUT_S) == 0
    finally:
        server.stop()


def test_core_killed_during_startup_is_named_by_its_signal(model_dir, tmp_path):
    server = ServerProcess(model_dir(MODEL_ARCH), tmp_path / "server.log", [])
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        cores: list[int] = []
        while not cores and time.monotonic() < deadline:
            cores = [c for c in children(server.proc.pid)
                     if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
            time.sleep(POLL_S)
        assert len(cores) == 1, server.log()
        os.kill(cores[0], signal.SIGKILL)
        assert server.proc.wait(STARTUP_TIMEOUT_S) == 1
        log = server.log()
        assert "serving" not in log  # it was killed before the server came up
        assert "killed by SIGKILL (out of memory?)" in log, log
        assert "exit code -9" not in log
    finally:
        server.stop()


# Start-up without the kernel build takes a few seconds here; the build phase is made longer
# than the whole timeout, so the start succeeds only if that phase is left out of it.
READY_TIMEOUT_S = 10.0
KERNEL_BUILD_SLEEP_S = 12.0


def test_kernel_build_is_not_counted_in_the_ready_timeout(model_dir, monkeypatch, caplog):
    from widellm.engine.arg_utils import EngineArgs
    from widellm.engine.core_client import EngineCoreClient
    from widellm.engine.core_proc import TEST_KERNEL_BUILD_SLEEP_ENV

    monkeypatch.setenv(TEST_KERNEL_BUILD_SLEEP_ENV, str(KERNEL_BUILD_SLEEP_S))
    args = EngineArgs(model=model_dir(MODEL_ARCH), dtype="float32", num_kv_blocks=64, max_model_len=256,
                      engine_ready_timeout_s=READY_TIMEOUT_S)
    caplog.set_level("INFO", logger="widellm.engine.core_client")
    client = EngineCoreClient(args.create_engine_config())
    try:
        assert client.num_kv_blocks == 64
        (line,) = [r.getMessage() for r in caplog.records if "building the CPU" in r.getMessage()]
        took = float(line.split(" took ")[1].split(" s ")[0])
        assert took >= KERNEL_BUILD_SLEEP_S
        assert line.endswith("(not counted in --engine-ready-timeout-s)")
    finally:
        client.shutdown()


def test_a_failed_start_stops_its_ranks_without_the_shutdown_grace(model_dir):
    """A start that times out kills its ranks at once: a rank still importing cannot read the
    shutdown message, so waiting SHUTDOWN_GRACE_S for it only delayed the error."""
    import multiprocessing

    from widellm.engine.arg_utils import EngineArgs
    from widellm.engine.core_client import SHUTDOWN_GRACE_S, EngineCoreClient

    # Far less than spawning a core and importing torch take: the start times out.
    args = EngineArgs(model=model_dir(MODEL_ARCH), dtype="float32", num_kv_blocks=64,
                      max_model_len=256, engine_ready_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"engine cores \[0\] not ready after"):
        EngineCoreClient(args.create_engine_config())
    assert time.monotonic() - start < SHUTDOWN_GRACE_S
    assert not [p for p in multiprocessing.active_children()
                if p.name.startswith("widellm-engine-core")]
