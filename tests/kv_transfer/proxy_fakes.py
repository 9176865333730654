"""Fake prefill and decode instances for the proxy tests (FastAPI apps served by uvicorn in
threads on free ports), a fake producer side channel, and readers of /metrics; the
``cluster`` fixture that starts the instances is in ``conftest.py``."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from widellm.kv_transfer.wire import Receiver, send_message

STARTUP_TIMEOUT_S = 10.0
GATE_TIMEOUT_S = 10.0
WAIT_S = 10.0
POLL_S = 0.01
ENGINE = "prefill-engine-0"  # the fake side channel's producer
SSE_CHUNKS = [b'data: {"id": "c1", "choices": [{"index": 0, "text": "Hel"}]}\n\n',
              b'data: {"id": "c1", "choices": [{"index": 0, "text": "lo"}]}\n\n',
              b"data: [DONE]\n\n"]
DECODE_ANSWER = {"id": "cmpl-1", "object": "text_completion",
                 "choices": [{"index": 0, "text": " world", "finish_reason": "length"}]}


class Served:
    """A FastAPI app served by uvicorn in a thread on a free port of 127.0.0.1."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        """Ask uvicorn to exit; ``join`` waits for it (apart, so that many stop together)."""
        self.server.should_exit = True

    def join(self) -> None:
        self.thread.join(STARTUP_TIMEOUT_S)
        self.sock.close()


class FakeBackend:
    """A prefill or decode instance: records what it is sent, answers as told."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.status = 200  # of the completion routes
        self.health_status = 200
        self.kv_params: dict | None = None  # set below to the prefill's answer
        self.gate: threading.Event | None = None  # holds a stream after its first chunk
        app = FastAPI()
        app.post("/v1/completions")(self._complete)
        app.post("/v1/chat/completions")(self._complete)
        app.get("/health")(self._health)
        app.get("/v1/models")(self._models)
        self.served = Served(app)
        self.url = self.served.url
        if role == "prefill":
            self.kv_params = {"do_remote_prefill": True, "do_remote_decode": False,
                              "remote_request_id": f"rid-{self.url}", "remote_host": "10.0.0.9",
                              "remote_port": 7777, "remote_block_ids": [3, 4]}

    async def _complete(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.status != 200:
            return JSONResponse({"error": {"message": f"{self.role} says no", "code": self.status}},
                                status_code=self.status)
        if self.role == "prefill":
            return {**DECODE_ANSWER, "kv_transfer_params": self.kv_params}
        if body.get("stream"):
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        return DECODE_ANSWER

    async def _stream(self):
        yield SSE_CHUNKS[0]
        if self.gate is not None:
            assert await asyncio.to_thread(self.gate.wait, GATE_TIMEOUT_S)
        for chunk in SSE_CHUNKS[1:]:
            yield chunk

    async def _health(self):
        return JSONResponse({}, status_code=self.health_status)

    async def _models(self):
        return {"object": "list", "data": [{"id": f"model-of-{self.url}"}]}


class FakeSideChannel:
    """A producer's side channel on a free port: records each message, answers ok."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.messages: list[dict] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                self.messages.append(Receiver(conn, time.monotonic() + WAIT_S).message())
                send_message(conn, {"ok": True})

    def wait_for(self, count: int) -> list[dict]:
        deadline = time.monotonic() + WAIT_S
        while len(self.messages) < count and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return self.messages

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        self.sock.close()
        self.thread.join(WAIT_S)

    def __enter__(self) -> "FakeSideChannel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dead_port() -> int:
    """A port of 127.0.0.1 nothing listens on (connections are refused at once)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def dead_url() -> str:
    return f"http://127.0.0.1:{dead_port()}"


def metric_values(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(url + "/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def requests_total(values: dict, pool: str, instance: str, status: str) -> float | None:
    key = frozenset({"pool": pool, "instance": instance, "status": status}.items())
    return values.get(("widellm:proxy_requests_total", key))


COMPLETION = {"model": "m", "prompt": "The capital of France is", "max_tokens": 5,
              "temperature": 0.0}
