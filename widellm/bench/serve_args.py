"""Flags of ``widellm bench serve`` (named as in ``vllm bench serve``) and the inputs they
name."""

from __future__ import annotations

import argparse
import json
import math
import os

from widellm.bench.serve import (
    API_KEY_ENV, CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, DEFAULT_BASE_URL,
    DEFAULT_READY_CHECK_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, MODELS_ENDPOINT,
)


def load_json_schema(value: str | None) -> dict | None:
    """``--json-schema``: inline JSON, or the path of a file holding it."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return json.load(f)
    return json.loads(value)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``widellm bench serve`` (named as in ``vllm bench serve``)."""
    parser.add_argument("--base-url", type=str, default=DEFAULT_BASE_URL,
                        help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--endpoint", type=str, default=COMPLETIONS_ENDPOINT,
                        help=f"{COMPLETIONS_ENDPOINT} (token-id prompts) or {CHAT_ENDPOINT} "
                             "(prompts decoded to text)")
    parser.add_argument("--model", type=str, default=None,
                        help=f"model name sent in requests; default: the first of "
                             f"{MODELS_ENDPOINT}")
    parser.add_argument("--tokenizer", type=str, default=None,
                        help="local tokenizer folder or .gguf file: gives the vocabulary size "
                             "and decodes chat prompts (default: --model if it is a path)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="draw prompt ids below this (default: the tokenizer's size)")
    parser.add_argument("--dataset", type=str, default="random", choices=["random"])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals; inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="at most this many requests in flight")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the prompts and the arrival times")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--api-key", type=str, default=os.environ.get(API_KEY_ENV),
                        help=f"bearer token (default: ${API_KEY_ENV})")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="seconds before one request is abandoned")
    parser.add_argument("--ready-check-timeout-sec", type=float,
                        default=DEFAULT_READY_CHECK_TIMEOUT_S,
                        help="send one untimed prompt first, retrying while the server does "
                             "not listen, for at most this long (0: skip the check)")
    parser.add_argument("--num-warmups", type=int, default=0,
                        help="untimed requests sent at --max-concurrency before the run")
    parser.add_argument("--output-json", type=str, default=None,
                        help="write the summary and every request's record here")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--json-schema", type=load_json_schema, default=None,
                        help="constrain every request to this JSON schema (a file or inline "
                             "JSON), sent as response_format")
