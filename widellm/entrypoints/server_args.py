"""Flags of ``widellm serve`` beyond the engine's own (kept apart from api_server.py so that
building the CLI parser does not import FastAPI and uvicorn)."""

from __future__ import annotations

import argparse
import os

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Largest ``n`` one request may ask for: each sample is a sequence in the batch.
DEFAULT_MAX_N = 16
API_KEY_ENV = "WIDELLM_API_KEY"
# The server's step token budget (the offline engine's is EngineArgs' 4,096), as vLLM's API
# server on CPU: prompts arriving together are then prefilled over several steps, so the first
# ones get their first token sooner; offline, one larger step wastes less per-step overhead.
SERVE_MAX_NUM_BATCHED_TOKENS = 2048
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def add_server_cli_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags, and its engine defaults where they differ from the offline
    engine's; call it after ``EngineArgs.add_cli_args`` on the same parser."""
    parser.add_argument("--host", type=str, default=DEFAULT_HOST,
                        help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    parser.add_argument("--api-key", type=str, default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on the API "
                             f"(default: ${API_KEY_ENV})")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                        help="largest n (samples per prompt) a request may ask for")
    parser.add_argument("--uvicorn-log-level", type=str, default="info",
                        choices=UVICORN_LOG_LEVELS)
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="do not log every HTTP request")
    parser.add_argument("--headless", action="store_true",
                        help="run this machine's data-parallel ranks (from "
                             "--data-parallel-start-rank) without an API server; they join "
                             "the head node at --data-parallel-address:--data-parallel-rpc-port")
    parser.set_defaults(max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)
