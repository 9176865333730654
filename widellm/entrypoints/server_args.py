"""Flags of ``widellm serve`` beyond the engine's own (kept apart from api_server.py so that
building the CLI parser does not import FastAPI and uvicorn)."""

from __future__ import annotations

import argparse
import os

from widellm.engine.generation_config import GENERATION_CONFIG_AUTO, GENERATION_CONFIG_IGNORE
from widellm.entrypoints.http_options import add_http_cli_args, check_http_args
from widellm.entrypoints.protocol import MAX_LOGPROBS
from widellm.entrypoints.tool_parsers import TOOL_PARSERS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Largest ``n`` one request may ask for: each sample is a sequence in the batch.
DEFAULT_MAX_N = 16
API_KEY_ENV = "WIDELLM_API_KEY"
# The server's step token budget (the offline engine's is EngineArgs' 4,096), as vLLM's API
# server on CPU: prompts arriving together are then prefilled over several steps, so the first
# ones get their first token sooner; offline, one larger step wastes less per-step overhead.
SERVE_MAX_NUM_BATCHED_TOKENS = 2048
# Largest request body accepted (413 beyond). A full 128k-token prompt is about 1 MB as token
# ids (up to 8 bytes each in JSON) and at most about 2 MB as text even when every character is
# JSON-escaped; 4 MiB leaves room for that and a few batched prompts while bounding what one
# request makes the API server parse: JSON parsing and validation hold the GIL, about a second
# per few MB of adversarial JSON (a long list of tiny values) on a small CPU.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20
# Kubernetes sends SIGKILL 30 s after SIGTERM by default: draining for 20 s leaves time to cut
# what is left, stop the engine cores and exit on our own.
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def _positive_int(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {value}")
    return number


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return number


def _seconds(value: str) -> float:
    number = float(value)
    if not number >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value}")
    return number


def check_server_args(args: argparse.Namespace) -> None:
    """Flag combinations that cannot work, refused before the model loads (ValueError)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (one of "
                         f"{', '.join(TOOL_PARSERS)})")
    if args.max_log_len is not None and not args.enable_log_requests:
        raise ValueError("--max-log-len needs --enable-log-requests (nothing is logged "
                         "without it)")
    check_http_args(args)


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
    parser.add_argument("--max-request-body-bytes", type=_positive_int,
                        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="refuse request bodies larger than this with a 413 (default "
                             f"{DEFAULT_MAX_REQUEST_BODY_BYTES >> 20} MiB)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="render a chat_template sent in a request (top level or in "
                             "chat_template_kwargs); without it such requests get a 400, "
                             "since a template is code that can run for minutes")
    parser.add_argument("--chat-template", type=str, default=None,
                        help="the chat template to render chats with instead of the model's: "
                             "a file, or the Jinja template itself")
    parser.add_argument("--max-logprobs", type=_non_negative_int, default=MAX_LOGPROBS,
                        help="the most top-N logprobs a request may ask for (logprobs, "
                             "top_logprobs, prompt_logprobs); more is a 400 "
                             "(default %(default)s)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help='name every token in logprobs "token_id:{id}" instead of its '
                             "text, as if each request sent return_tokens_as_token_ids")
    parser.add_argument("--generation-config", type=str, default=GENERATION_CONFIG_AUTO,
                        help=f"sampling defaults for fields a request leaves unset: "
                             f"{GENERATION_CONFIG_AUTO} (the model folder's "
                             f"generation_config.json), {GENERATION_CONFIG_IGNORE} (none: the "
                             f"API's defaults), or a folder holding a generation_config.json")
    parser.add_argument("--override-generation-config", type=str, default=None,
                        help='JSON overriding generation-config defaults, in its key names, '
                             'e.g. \'{"temperature": 0.5, "max_new_tokens": 128}\'')
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info (the tokenizer's configuration and "
                             "chat template), for clients that tokenize through the server "
                             "(lm-evaluation-harness's remote tokenizer)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let requests use tool_choice "auto" (the default when they send '
                             'tools): calls are found in the model\'s output by '
                             '--tool-call-parser, which this needs')
    parser.add_argument("--tool-call-parser", type=str, default=None,
                        choices=list(TOOL_PARSERS),
                        help="the format the served model writes tool calls in (hermes: "
                             "Qwen and Hermes models; llama3_json: Llama 3.1+; deepseek_v3)")
    parser.add_argument("--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="seconds running requests get to finish after SIGTERM before "
                             "they are ended with an error (default %(default)s)")
    parser.add_argument("--uvicorn-log-level", type=str, default="info",
                        choices=UVICORN_LOG_LEVELS)
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="do not log every HTTP request")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="drop the periodic throughput log line (prompt and generation "
                             "tokens/s, running and waiting requests, KV cache usage); "
                             "/metrics keeps every metric")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each request as it arrives: its id, sampling parameters, "
                             "prompt length and prompt (users' data: off by default)")
    parser.add_argument("--max-log-len", type=_non_negative_int, default=None,
                        help="with --enable-log-requests, log at most this many prompt "
                             "characters (or token ids) per request (default: all)")
    parser.add_argument("--disable-fastapi-docs", action="store_true",
                        help="serve no /openapi.json, /docs or /redoc")
    add_http_cli_args(parser)
    parser.add_argument("--config", type=str, default=None,
                        help="read flags from this YAML file, keyed by flag name (dashes or "
                             "underscores; 'model' for the model); flags on the command line "
                             "win over the file")
    parser.add_argument("--headless", action="store_true",
                        help="run this machine's data-parallel ranks (from "
                             "--data-parallel-start-rank) without an API server; they join "
                             "the head node at --data-parallel-address:--data-parallel-rpc-port")
    parser.set_defaults(max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)
