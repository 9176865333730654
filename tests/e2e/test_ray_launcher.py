"""``--data-parallel-backend ray`` end to end on a local Ray cluster (one head node started
here, stopped afterwards, even on failure): DP2 + EP with EPLB rebalancing mid-generation
gives the mp launcher's greedy tokens exactly, and shutdown frees every actor and the
placement group. Ray is an optional extra: without it the module skips."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import httpx  # noqa: E402

from tests.e2e.server_harness import (  # noqa: E402
    REQUEST_TIMEOUT_S, STOP_TIMEOUT_S, ServerProcess, free_port,
)
from tests.e2e.test_wide_ep import PLACEMENT  # noqa: E402
from widellm import LLM, SamplingParams  # noqa: E402
from widellm.engine.arg_utils import EngineArgs  # noqa: E402
from widellm.engine.core_client import EngineDeadError  # noqa: E402
from widellm.model.presets import resolve_preset  # noqa: E402

# Starting Ray costs ~5-20 s on 2 cores, each engine ~15 s: well under CI's limits.
pytestmark = pytest.mark.timeout(420)

CLUSTER_CPUS = 4  # room for the two ranks' bundles (one CPU each) and a spare pair
DP = 2
HEAD_START_TIMEOUT_S = 90.0
HEAD_STOP_GRACE_S = 30.0
RESOURCES_FREED_TIMEOUT_S = 30.0
POLL_S = 0.2
HEAD_READY_LINE = "Ray runtime started"
# The skewed preset gives EPLB hot experts to move; small windows rebalance within the run.
PRESET = "preset:deepseek-v3-tiny-skewed"
EPLB = dict(enable_eplb=True, eplb_num_redundant_experts=4, eplb_window_size=4,
            eplb_step_interval=8)
NUM_PROMPTS = 8
MAX_TOKENS = 24
NUM_KV_BLOCKS = 256
PR_SET_PDEATHSIG = 1  # prctl(2)


def test_without_a_cluster_the_error_says_how_to_start_one(monkeypatch):
    """Runs before the module's cluster starts: Ray would find that one."""
    from widellm.engine.ray_launcher import connect_ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    try:
        connect_ray()
    except RuntimeError as e:
        assert "ray start --head" in str(e)
        assert not ray.is_initialized()
        return
    ray.shutdown()
    pytest.skip("a Ray cluster already runs on this machine")


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM it if pytest dies without its finally blocks (a hard
    timeout), so the head node never outlives the test run."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _stop_head(proc: subprocess.Popen) -> None:
    """SIGTERM makes `ray start --block` stop every Ray process it started (what `ray stop`
    does, limited to this cluster: other Ray users of the machine are left alone); then kill
    whatever of its process group remains."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(HEAD_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the whole group is gone already
    proc.wait()


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster; yields its address (also in RAY_ADDRESS for the engine)."""
    # Ray's socket paths must stay under 108 bytes: a short folder under /tmp.
    temp_dir = tempfile.mkdtemp(prefix="wray", dir="/tmp")
    log_path = Path(temp_dir) / "head.log"
    port = free_port()
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
           "--node-ip-address", "127.0.0.1", "--port", str(port),
           "--num-cpus", str(CLUSTER_CPUS), "--include-dashboard=false",
           "--disable-usage-stats", "--temp-dir", temp_dir,
           # Ports with fixed defaults, so that two test runs on one machine never collide.
           "--metrics-export-port", str(free_port()),
           "--runtime-env-agent-port", str(free_port())]
    old_address = os.environ.get("RAY_ADDRESS")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_term_with_parent)
    try:
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while HEAD_READY_LINE not in log_path.read_text():
            assert proc.poll() is None, f"ray start failed:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"ray start hung:\n{log_path.read_text()}"
            time.sleep(POLL_S)
        address = f"127.0.0.1:{port}"
        os.environ["RAY_ADDRESS"] = address
        yield address
    finally:
        # Disconnect before the cluster goes: Ray ends a driver whose cluster vanished, and
        # this driver is pytest.
        ray.shutdown()
        if old_address is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old_address
        _stop_head(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _prompts() -> list[list[int]]:
    # Lengths 6..104: the ranks finish at different steps and idle ranks run dummy batches.
    return [[3 + (11 * i + 5 * j) % 250 for j in range(6 + 14 * i)] for i in range(NUM_PROMPTS)]


def _generate(path: str, **engine_kwargs):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, data_parallel_size=DP,
             enable_expert_parallel=True, **EPLB, **engine_kwargs) as llm:
        outs = llm.generate(_prompts(), params, use_tqdm=False,
                            data_parallel_rank=PLACEMENT[DP])
        client = llm.llm_engine.client
        stats = dict(client.eplb_stats)
        assert sorted(client.last_stats) == list(range(DP))
        assert all(s.kv_cache_usage == 0 for s in client.last_stats.values())
    return [o.outputs[0].token_ids for o in outs], stats


def _wait_all_cpus_free(address: str) -> None:
    """Every actor killed and the placement group removed: the cluster's CPUs are all free."""
    if not ray.is_initialized():  # the engine leaves this process connected
        ray.init(address=address)
    deadline = time.monotonic() + RESOURCES_FREED_TIMEOUT_S
    while ray.available_resources().get("CPU", 0) < CLUSTER_CPUS:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(POLL_S)
    tables = ray.util.placement_group_table().values()
    assert all(t["state"] == "REMOVED" for t in tables), list(tables)


def test_ray_dp2_ep_eplb_equals_mp(ray_cluster, tmp_path):
    path = resolve_preset(PRESET, cache_dir=str(tmp_path))
    expected, mp_stats = _generate(path)
    got, ray_stats = _generate(path, data_parallel_backend="ray")
    _wait_all_cpus_free(ray_cluster)
    assert got == expected
    for stats in (mp_stats, ray_stats):
        assert sorted(stats) == list(range(DP))
        assert all(s.num_rebalances >= 1 and s.num_failed_rebalances == 0
                   for s in stats.values()), stats


def test_dead_rank_fails_requests_and_frees_the_cluster(ray_cluster, tmp_path):
    """A rank's actor killed (as the OOM killer or a lost node would): requests fail with the
    dead rank named, and shutdown still removes every actor and the reservation."""
    path = resolve_preset(PRESET, cache_dir=str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, data_parallel_size=DP,
             enable_expert_parallel=True, data_parallel_backend="ray") as llm:
        client = llm.llm_engine.client
        victim = client.procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine core"):
            llm.generate(_prompts(), params, use_tqdm=False)
        # Named as the one that died, not rank 0 that stopped after its peer's failure.
        deadline = time.monotonic() + RESOURCES_FREED_TIMEOUT_S
        while victim.is_alive():
            assert time.monotonic() < deadline, "Ray never reported the killed actor"
            time.sleep(POLL_S)
        assert re.match(rf"engine core 1 \(pid {victim.pid}\) died: \w*Actor\w*Error",
                        client.dead_reason()), client.dead_reason()
    _wait_all_cpus_free(ray_cluster)


def test_serve_with_ray_answers_and_stops_on_sigterm(ray_cluster, tmp_path):
    """`widellm serve --data-parallel-backend ray`: the server keeps its own SIGTERM handling
    (ray.init would replace it), stops cleanly, and frees the cluster."""
    path = resolve_preset(PRESET, cache_dir=str(tmp_path))
    server = ServerProcess(path, tmp_path / "server.log", [
        "--data-parallel-size", str(DP), "--enable-expert-parallel",
        "--data-parallel-backend", "ray"])
    try:
        server.wait_ready()
        reply = httpx.post(f"{server.url}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
            "model": path, "prompt": _prompts()[3], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS
        server.proc.terminate()
        assert server.proc.wait(STOP_TIMEOUT_S) == 0, server.log()
    finally:
        server.stop()
    _wait_all_cpus_free(ray_cluster)


def test_ray_rejects_hand_placed_ranks(ray_cluster, tmp_path):
    """The launcher numbers the ranks per node itself; flags that place them by hand are an
    error, raised before Ray is touched."""
    from widellm.engine.ray_launcher import RayLauncher

    path = resolve_preset(PRESET, cache_dir=str(tmp_path))
    config = EngineArgs(model=path, data_parallel_size=DP, data_parallel_size_local=1,
                        data_parallel_backend="ray").create_engine_config()
    with pytest.raises(ValueError, match="places every rank itself"):
        RayLauncher(config)


def test_ray_cluster_too_small_fails_fast_and_cleans_up(ray_cluster, tmp_path, monkeypatch):
    """More CPUs than the cluster has: an error naming the shortfall at once, not a wait for
    the ready timeout; nothing is left reserved."""
    path = resolve_preset(PRESET, cache_dir=str(tmp_path))
    monkeypatch.setenv("WIDELLM_RAY_CPUS_PER_RANK", str(CLUSTER_CPUS))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="too small"):
        LLM(path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, data_parallel_size=DP,
            enable_expert_parallel=True, data_parallel_backend="ray")
    assert time.monotonic() - start < HEAD_START_TIMEOUT_S
    _wait_all_cpus_free(ray_cluster)
