"""Disaggregated prefill/decode under faults, each with both load-failure policies: a corrupted
and a short payload, a transfer that times out, a prefill instance killed mid-transfer and one
restarted under the same address (a new engine identity), a decode instance killed while the
prefill side holds its blocks, and a lease that runs out. ``recompute`` must give the colocated
tokens, ``fail`` a 500 with the cause; afterwards every live instance's KV usage is back to 0.

Faults are injected by the test-only fault file (``widellm.kv_transfer.faults``) the instances
read before each transfer."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from tests.e2e.disagg_utils import (
    decode, kv_flags, prefill, started, wait_for_metric,
)
from tests.e2e.server_harness import ServerProcess, free_port, metric, metrics
from widellm import LLM, SamplingParams
from widellm.kv_transfer.faults import FAULT_FILE_ENV

ARCH = "LlamaForCausalLM"
MAX_TOKENS = 8
LEASE_S = 2.5
TRANSFER_TIMEOUT_S = 2.0
STALL_S = 2 * TRANSFER_TIMEOUT_S
PROMPTS = [[5 + (13 * i + j) % 230 for j in range(40 + 9 * i)] for i in range(6)]
# A decode request the killed decode instance holds on to: far longer than the test waits.
LONG_DELAY_S = 120.0


@pytest.fixture(scope="module")
def expected(model_dir) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model_dir(ARCH), dtype="float32", num_kv_blocks=256) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


class Faults:
    """One fault file per instance."""

    def __init__(self, path) -> None:
        self.path = path
        self.set("")

    def set(self, fault: str) -> None:
        self.path.write_text(fault)

    @property
    def env(self) -> dict[str, str]:
        return {FAULT_FILE_ENV: str(self.path)}


@pytest.fixture(scope="module")
def side_port() -> int:
    return free_port()


def _prefill_server(model: str, tmp_path, side_port: int, faults: Faults, name: str):
    return ServerProcess(model, tmp_path / f"{name}.log",
                         kv_flags("kv_producer", lease_s=LEASE_S, side_channel_port=side_port,
                                  transfer_timeout_s=TRANSFER_TIMEOUT_S), faults.env)


def _decode_server(model: str, tmp_path, policy: str, faults: Faults, name: str):
    return ServerProcess(model, tmp_path / f"{name}.log",
                         kv_flags("kv_consumer", policy, transfer_timeout_s=TRANSFER_TIMEOUT_S),
                         faults.env)


@pytest.fixture(scope="module")
def deployment(model_dir, tmp_path_factory, side_port):
    """One prefill instance and a decode instance per policy."""
    tmp = tmp_path_factory.mktemp("faults")
    model = model_dir(ARCH)
    pf, rf, ff = Faults(tmp / "p.fault"), Faults(tmp / "r.fault"), Faults(tmp / "f.fault")
    servers = (_prefill_server(model, tmp, side_port, pf, "prefill"),
               _decode_server(model, tmp, "recompute", rf, "recompute"),
               _decode_server(model, tmp, "fail", ff, "fail"))
    with started(*servers):
        yield servers, pf


def _check_outcome(response, policy: str, want_text: str, cause: str | None) -> None:
    if policy == "recompute":
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == want_text
        return
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == 500 and "KV" in error["message"], error
    if cause is not None:
        assert f"({cause})" in error["message"], error


def _all_free(*servers: ServerProcess) -> None:
    for s in servers:
        wait_for_metric(s, "widellm:kv_cache_usage_perc", lambda v: v == 0, timeout_s=20)


@pytest.mark.parametrize("fault,cause", [("corrupt", "checksum"), ("short", "short_payload"),
                                         (f"stall:{STALL_S}", "timeout")])
def test_bad_transfer_each_policy(deployment, expected, fault, cause):
    (prefill_s, recompute_s, fail_s), faults = deployment
    for i, (server, policy) in enumerate(((recompute_s, "recompute"), (fail_s, "fail"))):
        before = metric(metrics(server), "widellm:kv_transfer_failures_total", cause=cause)
        params = prefill(prefill_s, PROMPTS[i])
        faults.set(fault)
        try:
            _check_outcome(decode(server, PROMPTS[i], params, MAX_TOKENS), policy, expected[i],
                           cause)
        finally:
            faults.set("")
        after = metric(metrics(server), "widellm:kv_transfer_failures_total", cause=cause)
        assert after == before + 1
    assert metric(metrics(recompute_s), "widellm:kv_transfer_recomputed_total") >= 1
    _all_free(prefill_s, recompute_s, fail_s)


def _streamed(prefill_s: ServerProcess, decode_s: ServerProcess, prompt: list[int],
              transfer: str, send_prefill: bool = True):
    """A streamed transfer as the proxy makes it: the decode request first (it pulls at
    once), then the prefill with the same transfer id; returns the decode's response."""
    info = httpx.get(prefill_s.url + "/kv_transfer/endpoints", timeout=10).json()
    rank = info["ranks"][0]
    params = {"do_remote_prefill": True, "transfer_id": transfer, "remote_request_id": transfer,
              "remote_engine_id": rank["remote_engine_id"], "remote_host": rank["remote_host"],
              "remote_port": rank["remote_port"], "block_size": info["block_size"]}
    result = {}
    waiter = threading.Thread(target=lambda: result.update(
        r=decode(decode_s, prompt, params, MAX_TOKENS)), daemon=True)
    waiter.start()
    if send_prefill:
        r = httpx.post(prefill_s.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer}})
        assert r.status_code == 200, r.text
    waiter.join(60)
    assert not waiter.is_alive()
    return result["r"]


@pytest.mark.parametrize("fault,cause", [("corrupt", "checksum"), ("short", "short_payload"),
                                         ("", "timeout")])
def test_streamed_transfer_faults_each_policy(deployment, expected, fault, cause):
    """A streamed transfer broken off mid-layer, or one whose prefill never comes (the
    decode's pull times out): the policy holds and nothing stays allocated."""
    (prefill_s, recompute_s, fail_s), faults = deployment
    for i, (server, policy) in enumerate(((recompute_s, "recompute"), (fail_s, "fail"))):
        before = metric(metrics(server), "widellm:kv_transfer_failures_total", cause=cause)
        faults.set(fault)
        try:
            response = _streamed(prefill_s, server, PROMPTS[i], f"{cause}-{policy}",
                                 send_prefill=bool(fault))
        finally:
            faults.set("")
        _check_outcome(response, policy, expected[i], cause)
        after = metric(metrics(server), "widellm:kv_transfer_failures_total", cause=cause)
        assert after == before + 1
    _all_free(prefill_s, recompute_s, fail_s)
    wait_for_metric(prefill_s, "widellm:kv_transfer_blocks_held", lambda v: v == 0)


def test_lease_expiry_frees_the_producers_blocks(deployment):
    (prefill_s, _, _), _ = deployment
    before = metric(metrics(prefill_s), "widellm:kv_transfer_leases_expired_total")
    prefill(prefill_s, PROMPTS[2])  # nobody ever pulls it
    assert metric(metrics(prefill_s), "widellm:kv_transfer_blocks_held") > 0
    wait_for_metric(prefill_s, "widellm:kv_transfer_blocks_held", lambda v: v == 0,
                    timeout_s=LEASE_S + 10)
    assert metric(metrics(prefill_s), "widellm:kv_transfer_leases_expired_total") == before + 1
    _all_free(prefill_s)


def test_decode_killed_while_holding_a_lease(deployment, model_dir, tmp_path):
    """The decode instance heartbeats while it waits to pull: the lease outlives its term; once
    the instance is killed, the lease runs out and the prefill side frees the blocks."""
    (prefill_s, _, _), _ = deployment
    slow = Faults(tmp_path / "slow.fault")
    slow.set(f"delay_pull:{LONG_DELAY_S}")
    victim = _decode_server(model_dir(ARCH), tmp_path, "fail", slow, "victim")
    expired = metric(metrics(prefill_s), "widellm:kv_transfer_leases_expired_total")
    with started(victim):
        params = prefill(prefill_s, PROMPTS[3])
        waiter = threading.Thread(target=lambda: _swallow(decode, victim, PROMPTS[3], params,
                                                          MAX_TOKENS), daemon=True)
        waiter.start()
        # Two lease terms later the blocks are still held: the heartbeats extended it.
        threading.Event().wait(2 * LEASE_S)
        assert metric(metrics(prefill_s), "widellm:kv_transfer_blocks_held") > 0
        assert metric(metrics(prefill_s),
                      "widellm:kv_transfer_leases_expired_total") == expired
        # Killed, server and engine core at once (a SIGTERM would first wait out the
        # graceful drain of the pull it holds): no more heartbeats.
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(LONG_DELAY_S)
    wait_for_metric(prefill_s, "widellm:kv_transfer_blocks_held", lambda v: v == 0,
                    timeout_s=LEASE_S + 10)
    assert metric(metrics(prefill_s), "widellm:kv_transfer_leases_expired_total") == expired + 1
    _all_free(prefill_s)


def _swallow(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # the instance is killed under it
        pass


def test_prefill_killed_mid_transfer_then_restarted(deployment, model_dir, tmp_path, expected,
                                                    side_port):
    """Killed mid-transfer (recompute: colocated tokens; fail: 500), killed with blocks still
    held (fail: 500), restarted under the same address: pulls made for the old engine are
    refused as another engine's (recompute and fail)."""
    (first, recompute_s, fail_s), _ = deployment
    model = model_dir(ARCH)
    params = [prefill(first, PROMPTS[i]) for i in range(2)]
    deployment[1].set("exit_mid_transfer")  # the module's prefill instance's fault file
    try:
        _check_outcome(decode(recompute_s, PROMPTS[0], params[0], MAX_TOKENS), "recompute",
                       expected[0], None)
        _check_outcome(decode(fail_s, PROMPTS[1], params[1], MAX_TOKENS), "fail", expected[1],
                       "connection")
    finally:
        deployment[1].set("")
    first.stop()
    again = Faults(tmp_path / "again.fault")
    second = _prefill_server(model, tmp_path, side_port, again, "prefill2")
    with started(second):
        p2 = prefill(second, PROMPTS[4])
        again.set("exit_mid_transfer")
        _check_outcome(decode(fail_s, PROMPTS[4], p2, MAX_TOKENS), "fail", expected[4], None)
    third = _prefill_server(model, tmp_path, side_port, Faults(tmp_path / "third.fault"),
                            "prefill3")
    with started(third):
        # The parameters name the first engine; the instance at that address is another.
        _check_outcome(decode(recompute_s, PROMPTS[0], params[0], MAX_TOKENS), "recompute",
                       expected[0], None)
        _check_outcome(decode(fail_s, PROMPTS[1], params[1], MAX_TOKENS), "fail", expected[1],
                       "engine_mismatch")
        assert metric(metrics(recompute_s), "widellm:kv_transfer_failures_total",
                      cause="engine_mismatch") == 1
        _all_free(third, recompute_s, fail_s)
