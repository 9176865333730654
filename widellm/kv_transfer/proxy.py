"""``widellm proxy``: one OpenAI-compatible front over disaggregated prefill and decode
instances, speaking vLLM's ``kv_transfer_params`` protocol.

Per request (the default, sequential flow; for the streamed one see ``proxy_streamed.py``):
a prefill instance computes the prompt's KV cache (``max_tokens`` 1, ``do_remote_decode``)
and answers with ``kv_transfer_params`` saying where those blocks are; a decode instance is
then sent the client's request with those params, pulls the blocks instead of recomputing
them, and generates; its answer (streamed or not) goes back to the client as it arrives.
Prefill is retried on other instances (it has no side effect the client sees); decode only
when the connection failed before the request was sent or the instance answered 503
(draining). A prefill whose decode never came (refused with a 4xx or a 503, or no decode
instance reached) is released (``prefill_release.py``).

No module-global state: each ``build_app`` owns its pools, httpx client and registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from http import HTTPStatus
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from widellm.kv_transfer.prefill_release import PrefillReleases
from widellm.kv_transfer.proxy_routing import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_LOAD_IMBALANCE,
    DEFAULT_REQUEST_TIMEOUT_S,
    BackendCall,
    InstancePool,
    ProxyMetrics,
    block_keys,
    prefill_body,
    prompt_text,
    skips_disaggregation,
)
from widellm.kv_transfer.proxy_streamed import StreamedFlow

logger = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
# The metrics' status label for a call that got no HTTP answer at all.
ERROR_STATUS = "error"
REQUEST_ID_HEADER = "x-request-id"
# A load balancer polls /health often; a hung instance must not hang the poll.
HEALTH_TIMEOUT_S = 2.0
# Idle connections kept per client; the total is unlimited (a proxy must not queue requests
# behind its own connection pool).
KEEPALIVE_CONNECTIONS = 64
# Characters of a failing backend's answer quoted in a 502 message.
ERROR_DETAIL_CHARS = 300
# Error ``type`` per status as the API server's (whose errors module imports the engine).
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.BAD_GATEWAY: "BadGateway",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


def _error_body(message: str, status: int) -> dict[str, Any]:
    """The OpenAI-style ``{"error": {...}}`` body, as the API server's."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"),
                      "param": None, "code": int(status)}}


def error_response(message: str, status: int) -> JSONResponse:
    return JSONResponse(_error_body(message, status), status_code=status)


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _passthrough(resp: httpx.Response, content: bytes, request_id: str) -> Response:
    return Response(content, status_code=resp.status_code,
                    media_type=resp.headers.get("content-type"),
                    headers={REQUEST_ID_HEADER: request_id})


class Proxy:
    """The request flow over a prefill pool and a decode pool."""

    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str],
                 max_load_imbalance: int = DEFAULT_MAX_LOAD_IMBALANCE,
                 kv_transfer_mode: str = "sequential") -> None:
        self.pools = {PREFILL: InstancePool(prefill_urls, max_load_imbalance),
                      DECODE: InstancePool(decode_urls, max_load_imbalance)}
        self.metrics = ProxyMetrics()
        self.releases = PrefillReleases(self.metrics.prefill_releases)
        self.client: httpx.AsyncClient | None = None  # opened by the app's lifespan
        # The streamed flow (prefill and decode at once; see proxy_streamed.py), if chosen.
        self.streamed = (StreamedFlow(self.pools[PREFILL], self.metrics)
                         if kv_transfer_mode == "streamed" else None)

    async def handle(self, request: Request, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            return error_response(f"malformed JSON body: {e}", HTTPStatus.BAD_REQUEST)
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object",
                                  HTTPStatus.BAD_REQUEST)
        path = CHAT_PATH if chat else COMPLETIONS_PATH
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        headers = {REQUEST_ID_HEADER: request_id}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        keys = block_keys(prompt_text(body, chat))
        decode_body, params = body, None
        if not skips_disaggregation(body):
            params = (await self.streamed.start(path, body, chat, keys, headers)
                      if self.streamed is not None else None)
            if params is None:  # the sequential flow
                params, failed = await self._prefill(path, prefill_body(body, chat), keys, headers)
                if failed is not None:
                    return failed
            if params is not None:  # None: the decode computes the prompt itself
                decode_body = {**body, "kv_transfer_params": params}
        response, taken = await self._decode(path, decode_body, keys, headers,
                                             bool(body.get("stream")))
        if params is not None and not taken:
            self.releases.start(params)
        return response

    async def _prefill(self, path: str, body: dict[str, Any], keys: list[bytes],
                       headers: dict[str, str]) -> tuple[dict | None, Response | None]:
        """(the prefill's ``kv_transfer_params``, None), or (None, the answer to give the
        client): a 4xx as the instance sent it, or a 502 once every instance failed."""
        pool = self.pools[PREFILL]
        tried: list[int] = []
        failures: list[str] = []
        while (index := pool.choose(keys, exclude=tried)) is not None:
            if tried:
                self.metrics.prefill_fallbacks.inc()
            tried.append(index)
            url = pool.urls[index]
            call = BackendCall(pool, self.metrics, PREFILL, index)
            try:
                resp = await self.client.post(url + path, json=body, headers=headers)
            except httpx.TransportError as e:  # refused, reset, timed out
                call.finish(ERROR_STATUS)
                pool.mark_failed(index)
                failures.append(f"{url}: {_describe(e)}")
                continue
            call.finish(resp.status_code)
            pool.mark_ok(index)
            if resp.status_code >= HTTPStatus.INTERNAL_SERVER_ERROR:
                failures.append(f"{url}: HTTP {resp.status_code}: "
                                f"{resp.text[:ERROR_DETAIL_CHARS]}")
                continue
            if not resp.is_success:  # the client's mistake: another instance would agree
                return None, _passthrough(resp, resp.content, headers[REQUEST_ID_HEADER])
            try:
                params = resp.json().get("kv_transfer_params")
            except (ValueError, AttributeError):
                failures.append(f"{url}: answered 200 with no JSON object")
                continue
            pool.record(index, keys)
            return (params if isinstance(params, dict) else None), None
        return None, error_response(
            "no prefill instance could prefill the request: " + "; ".join(failures),
            HTTPStatus.BAD_GATEWAY)

    async def _decode(self, path: str, body: dict[str, Any], keys: list[bytes],
                      headers: dict[str, str], stream: bool) -> tuple[Response, bool]:
        """(the decode instance's answer, streamed through when it is a 200 stream; whether an
        instance took the request: False after a 4xx or a 503, or when none could be
        reached). A 503 (a draining instance) moves on to the next instance, if any."""
        pool = self.pools[DECODE]
        request_id = headers[REQUEST_ID_HEADER]
        tried: list[int] = []
        failures: list[str] = []
        while (index := pool.choose(keys, exclude=tried)) is not None:
            tried.append(index)
            url = pool.urls[index]
            call = BackendCall(pool, self.metrics, DECODE, index)
            req = self.client.build_request("POST", url + path, json=body, headers=headers)
            try:
                resp = await self.client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                # Nothing reached the instance, so another one may take the request.
                call.finish(ERROR_STATUS)
                pool.mark_failed(index)
                failures.append(f"{url}: {_describe(e)}")
                continue
            except httpx.TransportError as e:  # it may have started: no retry
                call.finish(ERROR_STATUS)
                pool.mark_failed(index)
                return error_response(f"decode instance {url} failed: {_describe(e)}",
                                      HTTPStatus.BAD_GATEWAY), True
            if resp.status_code == HTTPStatus.SERVICE_UNAVAILABLE and len(tried) < len(pool):
                # Draining: it refused the request, or its shutdown ended it with nothing
                # sent. Another instance may take it: the prefill's blocks wait for whichever
                # consumer pulls them (if the first already had, the second's pull fails and
                # follows its kv_load_failure_policy).
                await resp.aclose()
                call.finish(resp.status_code)
                pool.mark_failed(index)
                failures.append(f"{url}: HTTP 503")
                continue
            pool.mark_ok(index)
            pool.record(index, keys)
            if stream and resp.status_code == HTTPStatus.OK:
                return StreamingResponse(
                    self._relay(resp, call, url), status_code=resp.status_code,
                    media_type=resp.headers.get("content-type"),
                    headers={REQUEST_ID_HEADER: request_id}), True
            try:
                content = await resp.aread()
            except httpx.TransportError as e:
                call.finish(ERROR_STATUS)
                return error_response(f"decode instance {url} failed: {_describe(e)}",
                                      HTTPStatus.BAD_GATEWAY), True
            finally:
                await resp.aclose()
            call.finish(resp.status_code)
            refused = (HTTPStatus.BAD_REQUEST <= resp.status_code < HTTPStatus.INTERNAL_SERVER_ERROR
                       or resp.status_code == HTTPStatus.SERVICE_UNAVAILABLE)
            return _passthrough(resp, content, request_id), not refused
        return error_response("no decode instance could be reached: " + "; ".join(failures),
                              HTTPStatus.BAD_GATEWAY), False

    async def _relay(self, resp: httpx.Response, call: BackendCall,
                     url: str) -> AsyncIterator[bytes]:
        """The decode's bytes as they arrive. A client that goes away closes this generator,
        which closes the backend connection, which aborts the request there."""
        try:
            async for chunk in resp.aiter_bytes():
                yield chunk
        except httpx.TransportError as e:
            call.finish(ERROR_STATUS)
            logger.warning("decode instance %s broke off a stream: %s", url, _describe(e))
            # The status line is long sent: say it in the stream, as the server does.
            error = _error_body(f"decode instance {url} failed: {_describe(e)}",
                                HTTPStatus.BAD_GATEWAY)
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            call.finish(resp.status_code)
            await resp.aclose()

    async def _instance_health(self, pool_name: str, index: int) -> dict[str, Any]:
        pool = self.pools[pool_name]
        url = pool.urls[index]
        try:
            resp = await self.client.get(url + "/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.TransportError as e:
            pool.mark_failed(index)
            return {"url": url, "status": None, "error": _describe(e)}
        pool.mark_ok(index)
        return {"url": url, "status": resp.status_code}

    async def health(self) -> Response:
        """200 when each pool has an instance whose own /health is 200, else 503 (all
        instances asked at once, so the answer takes one timeout at most)."""
        names = [(name, i) for name, pool in self.pools.items() for i in range(len(pool))]
        statuses = await asyncio.gather(*(self._instance_health(n, i) for n, i in names))
        report: dict[str, list[dict[str, Any]]] = {name: [] for name in self.pools}
        for (name, _), status in zip(names, statuses, strict=True):
            report[name].append(status)
        up = all(any(s["status"] == HTTPStatus.OK for s in pool) for pool in report.values())
        return JSONResponse(report, status_code=HTTPStatus.OK if up
                            else HTTPStatus.SERVICE_UNAVAILABLE)

    async def models(self, request: Request) -> Response:
        """/v1/models of the first decode instance that answers (healthy ones first)."""
        pool = self.pools[DECODE]
        order = sorted(range(len(pool)), key=lambda i: not pool.is_healthy(i))
        headers = {k: v for k, v in request.headers.items() if k == "authorization"}
        failures: list[str] = []
        for index in order:
            url = pool.urls[index]
            try:
                resp = await self.client.get(url + "/v1/models", headers=headers)
            except httpx.TransportError as e:
                pool.mark_failed(index)
                failures.append(f"{url}: {_describe(e)}")
                continue
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))
        return error_response("no decode instance could be reached: " + "; ".join(failures),
                              HTTPStatus.BAD_GATEWAY)


def _api_key_dependency(api_key: str):
    expected = f"Bearer {api_key}".encode()

    async def check_api_key(request: Request) -> None:
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, expected):  # constant time: no guessing by timing
            raise StarletteHTTPException(
                HTTPStatus.UNAUTHORIZED,
                "invalid or missing API key (send 'Authorization: Bearer KEY')")

    return check_api_key


def build_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], *,
              api_key: str | None = None,
              max_load_imbalance: int = DEFAULT_MAX_LOAD_IMBALANCE,
              request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
              connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
              kv_transfer_mode: str = "sequential") -> FastAPI:
    """The proxy app. A timeout of 0 means none."""
    proxy = Proxy(prefill_urls, decode_urls, max_load_imbalance, kv_transfer_mode)
    timeout = httpx.Timeout(request_timeout_s or None, connect=connect_timeout_s or None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=KEEPALIVE_CONNECTIONS)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            proxy.client = client
            if proxy.streamed is not None:
                proxy.streamed.client = client
            try:
                yield
            finally:
                if proxy.streamed is not None:
                    await proxy.streamed.close()
                await proxy.releases.close()
                proxy.client = None

    app = FastAPI(title="widellm proxy", lifespan=lifespan)
    app.state.proxy = proxy

    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    app.add_exception_handler(StarletteHTTPException, on_http_error)
    public = APIRouter()
    api = APIRouter(dependencies=[Depends(_api_key_dependency(api_key))] if api_key else [])

    @public.get("/health")
    async def health() -> Response:
        return await proxy.health()

    @public.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.models(request)

    @api.post(COMPLETIONS_PATH)
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, chat=False)

    @api.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, chat=True)

    app.include_router(public)
    app.include_router(api)
    return app
