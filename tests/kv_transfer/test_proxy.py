"""``widellm proxy`` against fake prefill and decode backends (FastAPI apps served by uvicorn in
threads on free ports): the request each backend gets, what the client gets back, failover,
health, metrics, API key; and the routing policy on its own. No engine, CPU only."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.kv_transfer.proxy_fakes import (
    COMPLETION, DECODE_ANSWER, GATE_TIMEOUT_S, SSE_CHUNKS, dead_url, metric_values,
    requests_total,
)

CLI_TIMEOUT_S = 60.0
PORT_RE = re.compile(r"http://127\.0\.0\.1:(\d+)(?= \(OpenAI)")
PREFILL_DEFAULT = {"do_remote_decode": True, "do_remote_prefill": False}
REPO = Path(__file__).resolve().parents[2]


def test_completion_goes_prefill_then_decode(cluster):
    p, d = cluster.pair()
    url = cluster.proxy([p.url], [d.url])
    r = httpx.post(url + "/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and r.json() == DECODE_ANSWER
    assert p.bodies == [{**COMPLETION, "max_tokens": 1, "stream": False, "n": 1,
                         "kv_transfer_params": PREFILL_DEFAULT}]
    assert d.bodies == [{**COMPLETION, "kv_transfer_params": p.kv_params}]
    rid = p.headers[0]["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and d.headers[0]["x-request-id"] == rid
    assert "authorization" not in p.headers[0]
    values = metric_values(url)
    assert requests_total(values, "prefill", p.url, "200") == 1.0
    assert requests_total(values, "decode", d.url, "200") == 1.0
    assert values[("widellm:proxy_prefill_fallbacks_total", frozenset())] == 0.0
    assert values[("widellm:proxy_requests_in_flight",
                   frozenset({"pool": "decode", "instance": d.url}.items()))] == 0.0
    assert values[("widellm:proxy_request_duration_seconds_count",
                   frozenset({"pool": "prefill"}.items()))] == 1.0


def test_chat_stream_passes_bytes_through_as_they_arrive(cluster):
    p, d = cluster.pair()
    d.gate = threading.Event()
    url = cluster.proxy([p.url], [d.url])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 7, "stream": True, "stream_options": {"include_usage": True}}
    got = b""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                      headers={"X-Request-Id": "req-42"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = r.iter_raw()
        while len(got) < len(SSE_CHUNKS[0]):  # the decode holds the rest until the gate opens
            got += next(chunks)
        assert got == SSE_CHUNKS[0]
        d.gate.set()
        got += b"".join(chunks)
    assert got == b"".join(SSE_CHUNKS)
    expected = {k: v for k, v in body.items() if k != "stream_options"}
    assert p.bodies == [{**expected, "max_completion_tokens": 1, "stream": False, "n": 1,
                         "kv_transfer_params": PREFILL_DEFAULT}]
    assert "max_tokens" not in p.bodies[0]
    assert d.bodies == [{**body, "kv_transfer_params": p.kv_params}]
    assert p.headers[0]["x-request-id"] == d.headers[0]["x-request-id"] == "req-42"


def test_client_leaving_a_stream_ends_the_decode_call(cluster):
    p, d = cluster.pair()
    d.gate = threading.Event()  # never set: the decode stream stays open until closed
    url = cluster.proxy([p.url], [d.url])
    with httpx.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        assert next(r.iter_raw()) == SSE_CHUNKS[0]
    key = ("widellm:proxy_requests_in_flight", frozenset({"pool": "decode",
                                                          "instance": d.url}.items()))
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while metric_values(url)[key] != 0.0:
        assert time.monotonic() < deadline, "the decode call is still counted in flight"
        time.sleep(0.02)
    d.gate.set()


def test_decode_error_on_a_stream_is_plain_json(cluster):
    p, d = cluster.pair()
    d.status = 503
    url = cluster.proxy([p.url], [d.url])
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": "decode says no", "code": 503}}
    assert requests_total(metric_values(url), "decode", d.url, "503") == 1.0


def test_prefill_5xx_falls_back_to_the_next(cluster):
    p0, p1 = cluster.backends("prefill", 2)
    (d,) = cluster.backends("decode", 1)
    p0.status = 500
    url = cluster.proxy([p0.url, p1.url], [d.url])
    r = httpx.post(url + "/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and r.json() == DECODE_ANSWER
    assert len(p0.bodies) == len(p1.bodies) == 1
    assert d.bodies == [{**COMPLETION, "kv_transfer_params": p1.kv_params}]
    values = metric_values(url)
    assert values[("widellm:proxy_prefill_fallbacks_total", frozenset())] == 1.0
    assert requests_total(values, "prefill", p0.url, "500") == 1.0
    assert requests_total(values, "prefill", p1.url, "200") == 1.0


def test_all_prefills_down_is_502(cluster):
    (d,) = cluster.backends("decode", 1)
    dead = [dead_url(), dead_url()]
    url = cluster.proxy(dead, [d.url])
    r = httpx.post(url + "/v1/completions", json=COMPLETION)
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["type"] == "BadGateway" and err["code"] == 502 and err["param"] is None
    assert err["message"].startswith("no prefill instance could prefill the request: ")
    assert dead[0] in err["message"] and dead[1] in err["message"]
    assert "ConnectError" in err["message"]
    assert d.bodies == []
    values = metric_values(url)
    assert requests_total(values, "prefill", dead[0], "error") == 1.0
    assert requests_total(values, "prefill", dead[1], "error") == 1.0
    assert values[("widellm:proxy_prefill_fallbacks_total", frozenset())] == 1.0


def test_prefill_4xx_is_the_clients_answer(cluster):
    p0, p1 = cluster.backends("prefill", 2)
    (d,) = cluster.backends("decode", 1)
    p0.status = 400
    url = cluster.proxy([p0.url, p1.url], [d.url])
    r = httpx.post(url + "/v1/completions", json=COMPLETION)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "prefill says no", "code": 400}}
    assert len(p0.bodies) == 1 and p1.bodies == [] and d.bodies == []


def test_prefill_without_params_lets_decode_compute(cluster):
    p, d = cluster.pair()
    p.kv_params = None
    url = cluster.proxy([p.url], [d.url])
    assert httpx.post(url + "/v1/completions", json=COMPLETION).status_code == 200
    assert len(p.bodies) == 1 and d.bodies == [COMPLETION]


@pytest.mark.parametrize("extra", [{"n": 2}, {"best_of": 3}, {"prompt": ["a", "b"]}])
def test_several_sequences_skip_prefill(cluster, extra):
    p, d = cluster.pair()
    url = cluster.proxy([p.url], [d.url])
    body = {**COMPLETION, **extra}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 200
    assert p.bodies == [] and d.bodies == [body]


def test_decode_connect_failure_tries_the_next_then_502(cluster):
    p, d = cluster.pair()
    dead = dead_url()
    url = cluster.proxy([p.url], [dead, d.url])
    assert httpx.post(url + "/v1/completions", json=COMPLETION).json() == DECODE_ANSWER
    assert len(d.bodies) == 1
    url2 = cluster.proxy([p.url], [dead])
    r = httpx.post(url2 + "/v1/completions", json=COMPLETION)
    assert r.status_code == 502 and r.json()["error"]["type"] == "BadGateway"
    assert dead in r.json()["error"]["message"]
    assert requests_total(metric_values(url2), "decode", dead, "error") == 1.0


def test_a_draining_decode_passes_the_request_to_the_next(cluster):
    """A 503 (a draining instance refuses new requests before its engine sees them) moves on
    to the next decode instance with the same prefill params; that instance is passed over
    for a while after."""
    (p,) = cluster.backends("prefill", 1)
    d0, d1 = cluster.backends("decode", 2)
    d0.status = 503
    url = cluster.proxy([p.url], [d0.url, d1.url])
    for _ in range(2):
        assert httpx.post(url + "/v1/completions", json=COMPLETION).json() == DECODE_ANSWER
    assert len(p.bodies) == 2 and len(d0.bodies) == 1 and len(d1.bodies) == 2
    assert d1.bodies[0]["kv_transfer_params"] == p.kv_params
    assert requests_total(metric_values(url), "decode", d0.url, "503") == 1.0


def test_api_key(cluster):
    p, d = cluster.pair()
    url = cluster.proxy([p.url], [d.url], api_key="sekret")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url + "/v1/completions", json=COMPLETION, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "AuthenticationError"
        assert r.json()["error"]["code"] == 401
    assert httpx.get(url + "/v1/models").status_code == 401
    assert p.bodies == [] and d.bodies == []
    good = {"Authorization": "Bearer sekret"}
    assert httpx.post(url + "/v1/completions", json=COMPLETION, headers=good).status_code == 200
    assert p.headers[0]["authorization"] == d.headers[0]["authorization"] == "Bearer sekret"
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


def test_health(cluster):
    p, d = cluster.pair()
    dead = dead_url()
    url = cluster.proxy([p.url, dead], [d.url])
    r = httpx.get(url + "/health")
    assert r.status_code == 200
    assert r.json()["decode"] == [{"url": d.url, "status": 200}]
    assert r.json()["prefill"][0] == {"url": p.url, "status": 200}
    assert r.json()["prefill"][1]["url"] == dead and r.json()["prefill"][1]["status"] is None
    d.health_status = 503
    r = httpx.get(url + "/health")
    assert r.status_code == 503 and r.json()["decode"] == [{"url": d.url, "status": 503}]
    url2 = cluster.proxy([p.url], [dead])
    assert httpx.get(url2 + "/health").status_code == 503


def test_models_from_first_answering_decode(cluster):
    p, d = cluster.pair()
    url = cluster.proxy([p.url], [dead_url(), d.url])
    assert httpx.get(url + "/v1/models").json()["data"] == [{"id": f"model-of-{d.url}"}]


def test_bad_body_is_400(cluster):
    p, d = cluster.pair()
    url = cluster.proxy([p.url], [d.url])
    for content in (b"{not json", b"[1, 2]"):
        r = httpx.post(url + "/v1/completions", content=content)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert p.bodies == [] and d.bodies == []


# --- routing, on its own -------------------------------------------------------------------

def test_cli_proxy_starts_and_serves(cluster):
    p, d = cluster.pair()
    cmd = [sys.executable, "-m", "widellm.entrypoints.cli", "proxy"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WIDELLM_API_KEY", None)
    helper = subprocess.Popen(cmd + ["--help"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(cmd + ["--prefill", p.url, "--decode", d.url, "--port", "0"],
                            cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + CLI_TIMEOUT_S
        lines: list[str] = []
        port = None
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "proxy exited: " + "".join(lines)
            lines.append(line)
            if m := PORT_RE.search(line):
                port = int(m.group(1))
        assert port is not None, "".join(lines)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=COMPLETION)
        assert r.json() == DECODE_ANSWER
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(CLI_TIMEOUT_S) == 0
        out, err = helper.communicate(timeout=CLI_TIMEOUT_S)
        assert helper.returncode == 0, err
        for flag in ("--prefill", "--decode", "--max-load-imbalance", "--request-timeout-s",
                     "--api-key"):
            assert flag in out
    finally:
        for child in (proc, helper):
            if child.poll() is None:
                child.kill()
                child.wait()
        proc.stderr.close()
