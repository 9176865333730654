"""A decode instance's server releases the prefill named by a request it refuses (a 4xx before
its engine took the request), over the producer's side channel (a fake that records what it
is sent); never for a 503 (a router retries that request elsewhere with the same params),
never from an instance that pulls no KV, and never for a caller without the API key."""

from __future__ import annotations

import argparse
import asyncio
from unittest.mock import MagicMock

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.kv_transfer.proxy_fakes import ENGINE, FakeSideChannel, dead_port
from widellm.entrypoints.api_server import build_app
from widellm.entrypoints.cli import build_parser
from widellm.kv_transfer.config import KVTransferConfig

# No release is sent within this long after the answer when none is due (a due one takes
# milliseconds: the answer does not wait for it, so the tests wait for the message).
QUIET_S = 0.5


@pytest.fixture
def side_channel():
    with FakeSideChannel() as channel:
        yield channel


def _engine(role: str, draining: bool = False) -> MagicMock:
    engine = MagicMock()  # the routes read names, flags and the connector config from it
    engine.model_config.served_names = ["m"]
    engine.errored = False
    engine.draining = draining
    engine.config.kv_transfer_config = KVTransferConfig(kv_connector="TCPConnector",
                                                        kv_role=role)
    engine.metrics.registry = CollectorRegistry()
    return engine


def _params(port: int) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": ENGINE,
            "remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "p-1",
            "remote_block_ids": [3, 4]}


def _post(engine: MagicMock, path: str, body: dict, *argv: str,
          headers: dict | None = None) -> int:
    args: argparse.Namespace = build_parser().parse_args(
        ["serve", "--generation-config", "vllm", *argv])
    app = build_app(engine, args)

    async def post() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            r = await client.post(path, json=body, headers=headers or {})
        await asyncio.sleep(QUIET_S)  # the release runs in the app's loop, after the answer
        return r.status_code

    return asyncio.run(post())


def _released(engine: MagicMock, outcome: str = "released") -> float | None:
    return engine.metrics.registry.get_sample_value(
        "widellm:refused_prefill_releases_total", {"outcome": outcome})


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path,body,status", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),  # refused by the route
    ("/v1/completions", {"prompt": "hi", "n": "three"}, 400),  # by the body's validation
    ("/v1/completions", {"prompt": "hi", "model": "other"}, 404),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400),
])
def test_a_refused_request_releases_its_prefill(side_channel, path, body, status):
    engine = _engine("kv_consumer")
    assert _post(engine, path, {**body, "kv_transfer_params": _params(side_channel.port)}) \
        == status
    assert side_channel.wait_for(1) == [{"op": "release", "engine_id": ENGINE,
                                         "request_ids": ["p-1"], "streamed": False}]
    assert _released(engine) == 1.0


def test_a_streamed_transfer_is_released_by_its_transfer_id(side_channel):
    engine = _engine("kv_both")
    params = {**_params(side_channel.port), "remote_request_id": "t-9", "transfer_id": "t-9"}
    assert _post(engine, "/v1/completions",
                 {"prompt": "hi", "max_tokens": -1, "kv_transfer_params": params}) == 400
    assert side_channel.wait_for(1) == [{"op": "release", "engine_id": ENGINE,
                                         "request_ids": ["t-9"], "streamed": True}]


@pytest.mark.parametrize("case", ["draining", "producer", "no_prefill", "unauthorized"])
def test_no_release_where_none_is_due(side_channel, case):
    engine = _engine("kv_producer" if case == "producer" else "kv_consumer",
                     draining=case == "draining")
    params = _params(side_channel.port)
    if case == "no_prefill":
        params["do_remote_prefill"] = False
    argv = ("--api-key", "k") if case == "unauthorized" else ()
    status = _post(engine, "/v1/completions",
                   {"prompt": "hi", "max_tokens": -1, "kv_transfer_params": params}, *argv)
    assert status == {"draining": 503, "unauthorized": 401}.get(case, 400)
    assert side_channel.messages == [] and _released(engine) is None


def test_an_unreachable_producer_is_counted_as_failed():
    engine = _engine("kv_consumer")
    assert _post(engine, "/v1/completions", {"prompt": "hi", "max_tokens": -1,
                                             "kv_transfer_params": _params(dead_port())}) == 400
    assert _released(engine, "failed") == 1.0
