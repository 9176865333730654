"""``widellm proxy`` lets go of a prefill's held KV blocks when no decode instance took the
request (a 4xx or 503 from decode, or no decode instance reachable), over a fake producer side
channel that records what it is sent; and only then (a decode that answered, or failed after
it may have started pulling, releases nothing from the proxy)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.kv_transfer.proxy_fakes import (
    COMPLETION, ENGINE, POLL_S, WAIT_S, FakeSideChannel, dead_port, dead_url, metric_values,
)
from widellm.kv_transfer.prefill_release import ReleaseTarget, release_target


@pytest.fixture
def side_channel():
    with FakeSideChannel() as channel:
        yield channel


def _params(port: int, rid: str) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": ENGINE,
            "remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": rid,
            "remote_block_ids": [3, 4], "lease_s": 30.0}


def _release(rid: str) -> dict:
    return {"op": "release", "engine_id": ENGINE, "request_ids": [rid], "streamed": False}


def _releases(url: str, outcome: str) -> float | None:
    key = ("widellm:proxy_prefill_releases_total", frozenset({("outcome", outcome)}))
    return metric_values(url).get(key)


def test_a_decode_refusal_releases_the_prefills_blocks(cluster, side_channel):
    p, d = cluster.pair()
    p.kv_params = _params(side_channel.port, "rid-refused")
    d.status = 400
    url = cluster.proxy([p.url], [d.url])
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "max_tokens": -1})
    assert r.status_code == 400 and len(p.bodies) == 1 and len(d.bodies) == 1
    assert side_channel.wait_for(1) == [_release("rid-refused")]
    assert _releases(url, "released") == 1.0


def test_no_reachable_decode_releases_the_prefills_blocks(cluster, side_channel):
    (p,) = cluster.backends("prefill", 1)
    p.kv_params = _params(side_channel.port, "rid-no-decode")
    url = cluster.proxy([p.url], [dead_url()])
    r = httpx.post(url + "/v1/completions", json=COMPLETION)
    assert r.status_code == 502
    assert side_channel.wait_for(1) == [_release("rid-no-decode")]


def test_a_draining_decode_with_none_to_fall_back_on_releases(cluster, side_channel):
    p, d = cluster.pair()
    p.kv_params = _params(side_channel.port, "rid-draining")
    d.status = 503
    url = cluster.proxy([p.url], [d.url])
    assert httpx.post(url + "/v1/completions", json=COMPLETION).status_code == 503
    assert side_channel.wait_for(1) == [_release("rid-draining")]


def test_a_decode_that_answered_releases_nothing(cluster, side_channel):
    """A 200 (the decode pulled) and a 500 (it may have started: its own connector releases)
    send nothing; a 4xx after them sends exactly its own release."""
    p, d = cluster.pair()
    url = cluster.proxy([p.url], [d.url])
    for status, rid in ((200, "rid-ok"), (500, "rid-failed"), (400, "rid-refused")):
        p.kv_params = _params(side_channel.port, rid)
        d.status = status
        assert httpx.post(url + "/v1/completions", json=COMPLETION).status_code == status
    assert side_channel.wait_for(1) == [_release("rid-refused")]
    assert _releases(url, "released") == 1.0


def test_a_release_nobody_answers_is_counted_and_the_client_is_not_kept(cluster):
    p, d = cluster.pair()
    p.kv_params = _params(dead_port(), "rid-lost")
    d.status = 422
    url = cluster.proxy([p.url], [d.url])
    assert httpx.post(url + "/v1/completions", json=COMPLETION).status_code == 422
    deadline = time.monotonic() + WAIT_S
    while _releases(url, "failed") != 1.0 and time.monotonic() < deadline:
        time.sleep(POLL_S)
    assert _releases(url, "failed") == 1.0 and _releases(url, "released") is None


def test_release_target():
    """The sequential flow's params name the producer's request id; the streamed flow's a
    transfer id (released early if the producer has not scheduled it yet); the file
    connector's no side channel."""
    assert release_target(_params(7000, "r1")) == ReleaseTarget(
        "127.0.0.1", 7000, ENGINE, "r1", False)
    streamed = {**_params(7001, "t1"), "transfer_id": "t1"}
    assert release_target(streamed) == ReleaseTarget("127.0.0.1", 7001, ENGINE, "t1", True)
    assert release_target({"kv_dir": "/tmp/kv", "remote_engine_id": ENGINE,
                           "remote_request_id": "r2"}) is None
