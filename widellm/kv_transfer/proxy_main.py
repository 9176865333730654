"""``widellm proxy`` as a process: bind its port (failing at once if taken), serve the app of
``proxy.py`` with uvicorn, log the address it really listens on, exit 0 on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from typing import Any

import uvicorn
from fastapi import FastAPI

from widellm.kv_transfer.proxy import build_app
from widellm.listen import bind_or_exit

logger = logging.getLogger(__name__)

STARTUP_POLL_S = 0.05
# Addresses meaning "every interface": the log then names one a local client can reach.
_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}
_LOCAL_HOST = "127.0.0.1"


def build_app_from_args(args: argparse.Namespace) -> FastAPI:
    return build_app(args.prefill, args.decode, api_key=args.api_key,
                     max_load_imbalance=args.max_load_imbalance,
                     request_timeout_s=args.request_timeout_s,
                     connect_timeout_s=args.connect_timeout_s,
                     kv_transfer_mode=args.kv_transfer_mode)


async def _serve(server: uvicorn.Server, sock: socket.socket, args: argparse.Namespace) -> None:
    """Run uvicorn on the bound ``sock`` and log its real address (even for --port 0)."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(STARTUP_POLL_S)
    if server.started:
        host, port = sock.getsockname()[:2]
        host = _LOCAL_HOST if host in _WILDCARD_HOSTS else host
        host = f"[{host}]" if ":" in host else host
        logger.info("widellm proxy at http://%s:%d (OpenAI-compatible proxy over %d prefill "
                    "and %d decode instances)", host, port, len(args.prefill), len(args.decode))
    await task


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(0)  # uvicorn re-raises SIGTERM after its shutdown: exit 0, not -15


def run_proxy(args: argparse.Namespace) -> None:
    """``widellm proxy``: bind the port (failing at once if it is taken), then serve."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sock = bind_or_exit(args.host, args.port)
    with sock:
        server = uvicorn.Server(uvicorn.Config(build_app_from_args(args),
                                               log_level=args.uvicorn_log_level))
        try:
            asyncio.run(_serve(server, sock, args))
        except KeyboardInterrupt:
            pass
    if not server.started:
        sys.exit(1)  # uvicorn could not start (it logged why)
