"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncLLM`` (whose engine core
runs in its own process), served by uvicorn.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize,
POST /detokenize, GET /tokenizer_info with --enable-tokenizer-info-endpoint (behind --api-key
when it is set), and GET /health, /version, /metrics (always open, for load balancers and
scrapers). Every error is ``{"error": {...}}`` with a 4xx for bad input, so no request can take
the server down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import sys
import time
from http import HTTPStatus

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

import widellm
from widellm.engine.arg_utils import EngineArgs
from widellm.engine.async_llm import AsyncLLM, EngineDrainingError
from widellm.engine.core_client import EngineDeadError
from widellm.engine.generation_config import default_sampling_params
from widellm.engine.request_logger import RequestLogger
from widellm.entrypoints.body_limit import BodySizeLimitMiddleware
from widellm.entrypoints.chat_template import load_chat_template
from widellm.entrypoints.drain import DrainingServer
from widellm.entrypoints.errors import APIError, param_of, to_api_error
from widellm.entrypoints.http_options import (
    RootPathMiddleware, cors_options, uses_tls, uvicorn_tls_kwargs,
)
from widellm.entrypoints.protocol import (
    CompletionRequest, DetokenizeRequest, ModelCard, ModelList, VersionResponse,
)
from widellm.entrypoints.protocol_chat import ChatCompletionRequest, TokenizeRequest
from widellm.entrypoints.refused_prefills import RefusedPrefills
from widellm.entrypoints.server_args import check_server_args
from widellm.entrypoints.serving_base import tokenizer_executor
from widellm.entrypoints.serving_chat import OpenAIServingChat
from widellm.entrypoints.serving_completion import OpenAIServingCompletion
from widellm.entrypoints.serving_tokenization import OpenAIServingTokenization
from widellm.gc_heap import freeze_startup_heap
from widellm.kv_transfer.registry import supports_streaming
from widellm.listen import bind_or_exit

logger = logging.getLogger(__name__)

STARTUP_POLL_S = 0.05
# Validation errors listed in one message; a bad union field alone can raise a handful.
MAX_VALIDATION_ERRORS = 3
VALUE_ERROR_PREFIX = "Value error, "
# pydantic's words for a body that is not a JSON object at all, in the client's terms.
WHOLE_BODY_ERRORS = {
    "missing": "the request body is missing; send a JSON object",
    "model_attributes_type": "the request body must be a JSON object "
                             "(with Content-Type: application/json)",
}


def _validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's complaints about a request body as one 400."""
    parts: list[str] = []
    param = None
    for err in exc.errors()[:MAX_VALIDATION_ERRORS]:
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", err.get("msg", ""))
            return APIError(f"malformed JSON body: {detail}", HTTPStatus.BAD_REQUEST)
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = str(err.get("msg", "")).removeprefix(VALUE_ERROR_PREFIX)
        if not loc and err.get("type") in WHOLE_BODY_ERRORS:
            msg = WHOLE_BODY_ERRORS[err["type"]]
        param = param or (loc[0] if loc else param_of(msg))
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return APIError("; ".join(parts) or "invalid request", HTTPStatus.BAD_REQUEST, param)


def add_exception_handlers(app: FastAPI, refused: RefusedPrefills | None = None) -> None:
    """Every failure as an OpenAI-style error; a body that fails validation and names a
    remote prefill has that prefill released (``refused``)."""
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        err = to_api_error(exc)
        if err.status >= HTTPStatus.INTERNAL_SERVER_ERROR:
            logger.error("request failed: %s", err.message)
        return err.to_response()

    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        if refused is not None:
            refused.refused_body(exc.body)
        return _validation_error(exc).to_response()

    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(str(exc.detail), exc.status_code).to_response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(ValueError, on_api_error)
    app.add_exception_handler(EngineDeadError, on_api_error)
    # Listed, not left to the catch-all: Starlette re-raises (and uvicorn logs a traceback
    # for) whatever reaches its Exception handler.
    app.add_exception_handler(EngineDrainingError, on_api_error)
    app.add_exception_handler(Exception, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)


def api_key_dependency(api_key: str):
    """A route dependency accepting only ``Authorization: Bearer <api_key>``."""
    expected = f"Bearer {api_key}".encode()

    async def check_api_key(request: Request) -> None:
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, expected):  # constant time: no guessing by timing
            raise APIError("invalid or missing API key (send 'Authorization: Bearer KEY')",
                           HTTPStatus.UNAUTHORIZED)

    return check_api_key


def add_guarded_docs(router: APIRouter, app: FastAPI) -> None:
    """``/openapi.json``, ``/docs`` and ``/redoc`` on ``router`` (FastAPI's own pages)."""

    def schema_url(request: Request) -> str:
        # Behind --root-path the browser fetches the schema through the proxy's prefix.
        return request.scope.get("root_path", "").rstrip("/") + "/openapi.json"

    @router.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        schema = app.openapi()
        root_path = request.scope.get("root_path", "").rstrip("/")
        if root_path:  # as FastAPI's own route: the prefix is where clients reach the API
            schema = {**schema, "servers": [{"url": root_path}]}
        return JSONResponse(schema)

    @router.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> Response:
        return get_swagger_ui_html(openapi_url=schema_url(request),
                                   title=f"{app.title} - docs")

    @router.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> Response:
        return get_redoc_html(openapi_url=schema_url(request), title=f"{app.title} - ReDoc")


def serving_options(engine: AsyncLLM, args: argparse.Namespace) -> dict:
    """What every endpoint shares from the flags: the chat template, the logprobs cap and the
    generation-config defaults (logged, as vLLM does: they change answers)."""
    defaults = default_sampling_params(args.generation_config, engine.model_config.model,
                                       args.override_generation_config)
    if defaults:
        logger.info("default sampling parameters (generation config; a request's own values "
                    "win; --generation-config vllm ignores them): %s", defaults)
    return dict(trust_request_chat_template=args.trust_request_chat_template,
                max_logprobs=args.max_logprobs, default_sampling_params=defaults,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                chat_template=load_chat_template(args.chat_template))


def build_app(engine: AsyncLLM, args: argparse.Namespace) -> FastAPI:
    """The app for ``engine``; ``args`` gives ``api_key``, ``max_n``,
    ``max_request_body_bytes``, ``enable_tokenizer_info_endpoint`` and what
    ``serving_options`` reads."""
    served = engine.model_config.served_names
    # /v1/models' "created": when this server made the model available, the same in every
    # answer (a per-request time would differ between two listings a second apart).
    created = int(time.time())
    pool = tokenizer_executor()
    refused = RefusedPrefills(engine.config.kv_transfer_config, engine.metrics.registry)
    options = dict(executor=pool, **serving_options(engine, args))
    completion = OpenAIServingCompletion(engine, served, args.max_n, **options)
    chat = OpenAIServingChat(engine, served, args.max_n, **options,
                             enable_auto_tool_choice=args.enable_auto_tool_choice,
                             tool_call_parser=args.tool_call_parser)
    tokenization = OpenAIServingTokenization(engine, served, args.max_n, **options)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:  # a tokenization still running ends on its own; queued ones never start
            pool.shutdown(wait=False, cancel_futures=True)
            await refused.close()

    # With an API key the schema and its UIs are served by the guarded router below, so they
    # describe the API only to those who may call it.
    own_docs = not args.api_key and not args.disable_fastapi_docs
    docs_urls = {} if own_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="widellm", version=widellm.__version__, lifespan=lifespan, **docs_urls)
    add_exception_handlers(app, refused)
    if args.root_path:
        app.add_middleware(RootPathMiddleware, root_path=args.root_path)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=args.max_request_body_bytes)
    cors = cors_options(args)
    if cors is not None:  # added last, so outermost: preflights and 4xx answers get headers
        app.add_middleware(CORSMiddleware, **cors)
    guarded = [Depends(api_key_dependency(args.api_key))] if args.api_key else []
    api = APIRouter(dependencies=guarded)
    public = APIRouter()
    if args.api_key and not args.disable_fastapi_docs:
        add_guarded_docs(api, app)

    @public.get("/health")
    async def health() -> Response:
        if engine.errored:
            reason = engine.dead_error or "engine core process is not running"
            return APIError(f"the engine is dead: {reason}",
                            HTTPStatus.SERVICE_UNAVAILABLE).to_response()
        return Response(status_code=HTTPStatus.OK)

    @public.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=widellm.__version__)

    @public.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models() -> ModelList:
        config = engine.model_config
        return ModelList(data=[ModelCard(id=name, created=created, root=config.model,
                                         max_model_len=config.max_model_len) for name in served])

    @api.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        with refused.on_refusal(request.kv_transfer_params):
            return await completion.create_completion(request, raw_request)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        with refused.on_refusal(request.kv_transfer_params):
            return await chat.create_chat_completion(request, raw_request)

    @api.get("/kv_transfer/endpoints")
    async def kv_transfer_endpoints() -> Response:
        """Where each rank's KV connector is reached: what a proxy puts into the decode
        request of a streamed transfer (see ``widellm/kv_transfer/streams.py``)."""
        kvt = engine.config.kv_transfer_config
        if kvt is None:
            return APIError("this instance runs no KV connector",
                            HTTPStatus.NOT_FOUND).to_response()
        ranks = [{"dp_rank": rank, **ep} for rank, ep in sorted(engine.client.kv_endpoints.items())]
        return JSONResponse({"kv_connector": kvt.kv_connector, "kv_role": kvt.kv_role,
                             "block_size": engine.config.cache_config.block_size,
                             "streams": supports_streaming(kvt), "ranks": ranks})

    @api.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        return JSONResponse((await tokenization.tokenize(request)).model_dump())

    @api.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        return JSONResponse((await tokenization.detokenize(request)).model_dump())

    if args.enable_tokenizer_info_endpoint:  # off by default, as vLLM: it shows the template
        @api.get("/tokenizer_info")
        async def tokenizer_info() -> Response:
            return JSONResponse(tokenization.tokenizer_info())

    app.include_router(public)
    app.include_router(api)
    return app


def log_usage(url: str, model: str, api_key: str | None) -> None:
    """One line saying where the server is and a curl command that calls it."""
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 16})
    # Double quotes so the shell expands the variable; single quotes sent it literally (401).
    auth = ' -H "Authorization: Bearer $WIDELLM_API_KEY"' if api_key else ""
    logger.info("widellm %s serving %s at %s (OpenAI API under /v1). Try:\n"
                "  curl %s/v1/completions -H 'Content-Type: application/json'%s -d '%s'",
                widellm.__version__, model, url, url, auth, body)


async def serve_http(server: uvicorn.Server, sock: socket.socket, model: str,
                     api_key: str | None, scheme: str = "http") -> None:
    """Run uvicorn on the already bound ``sock``, logging its address (the real port, even
    for --port 0)."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(STARTUP_POLL_S)
    if server.started and server.servers and server.servers[0].sockets:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        log_usage(f"{scheme}://{host}:{port}", model, api_key)
    await task


def _exit_on_sigterm(signum: int, _frame) -> None:
    # uvicorn handles SIGTERM itself while serving and re-raises it afterwards; exiting by an
    # exception (not the default action) lets the engine core be shut down on the way out.
    raise SystemExit(0)


def run_server(args: argparse.Namespace) -> None:
    """``widellm serve``: bind the HTTP port, start the engine core, then serve HTTP until
    SIGINT/SIGTERM.

    The port is bound first so that a taken port fails at once, not after the model loads,
    and so that no ephemeral port the engine opens meanwhile (ZMQ, gloo) can take it.
    """
    check_server_args(args)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sock = bind_or_exit(args.host, args.port)
    with sock:
        request_logger = RequestLogger(args.max_log_len) if args.enable_log_requests else None
        engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args),
                                           log_stats=not args.disable_log_stats,
                                           request_logger=request_logger)
        try:
            app = build_app(engine, args)
        except BaseException:  # a bad frontend flag: the engine cores must not outlive us
            engine.shutdown()
            raise
        config = uvicorn.Config(
            app, log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log, **uvicorn_tls_kwargs(args),
        )
        server = DrainingServer(config, engine, args.shutdown_timeout)

        async def main() -> None:
            try:
                await serve_http(server, sock, engine.model_config.served_name, args.api_key,
                                 "https" if uses_tls(args) else "http")
            finally:
                engine.shutdown()

        freeze_startup_heap("API server")
        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            pass
    if not server.started:
        sys.exit(1)  # uvicorn could not start (it logged why)
