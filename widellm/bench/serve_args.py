"""Flags of ``widellm bench serve``: those of ``vllm bench serve`` (vllm/benchmarks/serve.py
and vllm/benchmarks/datasets/arg_utils.py) with its defaults, plus a few widellm extras
(token-id prompts, fixed output lengths, JSON-schema outputs, a retrying ready check)."""

from __future__ import annotations

import argparse
import json
import math
import os
from types import MappingProxyType

from widellm.bench.serve_metrics import GOODPUT_METRICS, LATENCY_METRICS
from widellm.bench.serve_request import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, MODELS_ENDPOINT

API_KEY_ENV = "OPENAI_API_KEY"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Per request; long enough that only a hung server ever hits it.
DEFAULT_REQUEST_TIMEOUT_S = 3600.0
DEFAULT_READY_CHECK_TIMEOUT_S = 600.0
BACKEND_ENDPOINTS = MappingProxyType({"openai": COMPLETIONS_ENDPOINT,
                                      "openai-chat": CHAT_ENDPOINT})
PREFIX_REPETITION = "prefix_repetition"
# vLLM spells it with an underscore; the hyphen reads like every other flag value.
DATASET_ALIASES = MappingProxyType({"prefix-repetition": PREFIX_REPETITION})
DATASETS = ("random", "sharegpt", PREFIX_REPETITION, *DATASET_ALIASES)
SYNTHETIC_DATASETS = ("random", PREFIX_REPETITION)
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"
DEFAULT_METRIC_PERCENTILES = "99"
# Flags sent as sampling fields when given (vLLM's sampling group); the rest stay unset so
# the server's defaults apply.
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                  "presence_penalty", "repetition_penalty")


def load_json_schema(value: str | None) -> dict | None:
    """``--json-schema``: inline JSON, or the path of a file holding it."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return json.load(f)
    return json.loads(value)


def _dataset_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", "--dataset", dest="dataset_name", default="random",
                        choices=DATASETS)
    parser.add_argument("--dataset-path", type=str, default=None,
                        help="local ShareGPT JSON file (nothing is downloaded)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the prompts and the arrival times")
    parser.add_argument("--disable-shuffle", action="store_true")
    parser.add_argument("--no-oversample", action="store_true",
                        help="fail instead of repeating prompts when the file has too few")
    parser.add_argument("--input-len", type=int, default=None,
                        help="sets --random-input-len")
    parser.add_argument("--output-len", type=int, default=None,
                        help="sets every dataset's output length")
    g = parser.add_argument_group("random dataset")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)], r in [0, 1)")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of one fixed prefix before every prompt's random ones")
    g.add_argument("--token-id-prompts", action="store_true",
                   help="(widellm) send the random token ids as the prompt instead of their "
                        "decoded text (completions only)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="(widellm) draw ids below this (default: the tokenizer's size); with "
                        "--token-id-prompts, no tokenizer is needed")
    g = parser.add_argument_group("sharegpt dataset")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="output length of every request (default: the reply's length)")
    g = parser.add_argument_group("prefix repetition dataset")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling (sent only when given)")
    for name in SAMPLING_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), type=int if name == "top_k" else float,
                       default=None)
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (not OpenAI's)")
    g.add_argument("--fixed-output-len", action="store_true",
                   help="(widellm) send ignore_eos and min_tokens = max tokens, so every "
                        "request generates exactly its output length (not OpenAI's fields)")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--extra-body", type=json.loads, default=None,
                   help="JSON object merged into every request")
    g.add_argument("--json-schema", type=load_json_schema, default=None,
                   help="(widellm) constrain every request to this JSON schema (a file or "
                        "inline JSON), sent as response_format")


def _output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--percentile-metrics", type=str, default=DEFAULT_PERCENTILE_METRICS,
                        help="comma-separated, of " + ",".join(m for m, *_ in LATENCY_METRICS))
    parser.add_argument("--metric-percentiles", type=str, default=DEFAULT_METRIC_PERCENTILES,
                        help='comma-separated percentiles, e.g. "50,90,99"')
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 (of "
                             + ", ".join(GOODPUT_METRICS) + ")")
    parser.add_argument("--save-result", action="store_true", help="write the result JSON")
    parser.add_argument("--save-detailed", action="store_true",
                        help="also write per-request arrays (input_lens, ttfts, itls, ...)")
    parser.add_argument("--append-result", action="store_true",
                        help="append the result JSON as one line to the file")
    parser.add_argument("--result-dir", type=str, default=None)
    parser.add_argument("--result-filename", type=str, default=None)
    parser.add_argument("--label", type=str, default=None,
                        help="result file name prefix (default: --backend)")
    parser.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                        help="extra keys for the result JSON")
    parser.add_argument("--output-json", type=str, default=None,
                        help="(widellm) write the result JSON here (like --save-result "
                             "--result-filename)")
    parser.add_argument("--disable-tqdm", action="store_true")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``widellm bench serve`` (named and defaulted as in ``vllm bench serve``)."""
    parser.add_argument("--backend", choices=tuple(BACKEND_ENDPOINTS), default=None,
                        help="openai (completions) or openai-chat (default: from --endpoint, "
                             "else openai)")
    parser.add_argument("--base-url", type=str, default=None,
                        help="server root, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    parser.add_argument("--host", type=str, default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--endpoint", type=str, default=None,
                        help=f"default: {COMPLETIONS_ENDPOINT} for openai, {CHAT_ENDPOINT} "
                             "for openai-chat")
    parser.add_argument("--header", nargs="*", default=None, metavar="KEY=VALUE")
    parser.add_argument("--api-key", type=str, default=os.environ.get(API_KEY_ENV),
                        help=f"bearer token (default: ${API_KEY_ENV})")
    parser.add_argument("--model", type=str, default=None,
                        help=f"model name (default: the first of {MODELS_ENDPOINT}); a local "
                             "path also serves as the tokenizer")
    parser.add_argument("--served-model-name", type=str, default=None,
                        help="model name sent in requests, when it differs from --model")
    parser.add_argument("--tokenizer", type=str, default=None,
                        help="local tokenizer folder or .gguf file (default: --model or the "
                             "server's model if a local path, else the default model's)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps: 1 is Poisson, lower burstier")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="at most this many requests in flight")
    parser.add_argument("--num-warmups", type=int, default=0,
                        help="untimed requests at --max-concurrency before the run")
    parser.add_argument("--ready-check-timeout-sec", type=float,
                        default=DEFAULT_READY_CHECK_TIMEOUT_S,
                        help="send one untimed prompt first, retrying while the server does "
                             "not listen, for at most this long (0: skip the check)")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="(widellm) seconds before one request is abandoned")
    _dataset_args(parser)
    _sampling_args(parser)
    _output_args(parser)


def parse_key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    """``KEY=VALUE`` items as a dict."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} takes KEY=VALUE items, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``--goodput ttft:500 tpot:50`` as {metric: bound in ms}."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        try:
            bound = float(value)
        except ValueError:
            bound = None
        if not sep or bound is None:
            raise ValueError(f"--goodput takes METRIC:MILLISECONDS items, got {item!r}")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput metric must be one of {', '.join(GOODPUT_METRICS)}, "
                             f"got {name!r}")
        if bound < 0:
            raise ValueError(f"--goodput bound must be non-negative, got {item!r}")
        slos[name] = bound
    return slos


def parse_percentile_metrics(value: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    known = tuple(m for m, *_ in LATENCY_METRICS)
    for name in names:
        if name not in known:
            raise ValueError(f"--percentile-metrics takes {','.join(known)}, got {name!r}")
    return names


def parse_percentiles(value: str) -> tuple[float, ...]:
    try:
        percentiles = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers, got {value!r}") from None
    if not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must lie in [0, 100], got {value!r}")
    return percentiles


def _resolve_backend(args: argparse.Namespace) -> None:
    if args.backend is None:
        chat = args.endpoint is not None and args.endpoint.rstrip("/").endswith(CHAT_ENDPOINT)
        args.backend = "openai-chat" if chat else "openai"
    if args.endpoint is None:
        args.endpoint = BACKEND_ENDPOINTS[args.backend]
    if (args.backend == "openai-chat") != args.endpoint.rstrip("/").endswith("chat/completions"):
        raise ValueError(f"--backend {args.backend} does not fit --endpoint {args.endpoint}")
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    args.base_url = args.base_url.rstrip("/")


def _validate(args: argparse.Namespace) -> None:
    positive = {"--num-prompts": args.num_prompts, "--request-rate": args.request_rate,
                "--burstiness": args.burstiness, "--request-timeout": args.request_timeout,
                "--random-input-len": args.random_input_len,
                "--random-output-len": args.random_output_len}
    at_least_zero = {"--ready-check-timeout-sec": args.ready_check_timeout_sec,
                     "--num-warmups": args.num_warmups,
                     "--random-prefix-len": args.random_prefix_len}
    if args.max_concurrency is not None:
        positive["--max-concurrency"] = args.max_concurrency
    for flag, value in positive.items():
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    for flag, value in at_least_zero.items():
        if not value >= 0:
            raise ValueError(f"{flag} must be at least 0, got {value}")
    if args.dataset_name in SYNTHETIC_DATASETS and args.dataset_path is not None:
        raise ValueError(f"--dataset-name {args.dataset_name} takes no --dataset-path")
    if args.dataset_name == "sharegpt" and args.dataset_path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a local JSON file)")
    if args.token_id_prompts and (args.dataset_name != "random" or args.backend != "openai"):
        raise ValueError("--token-id-prompts needs --dataset-name random and --backend openai")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the derived settings into ``args`` (idempotent) and validate them, raising
    ValueError with the flag to fix: backend and endpoint from each other, the base URL from
    --host/--port, the general lengths into the datasets' own, and parsed forms of the
    metric, goodput, header and metadata flags."""
    args.dataset_name = DATASET_ALIASES.get(args.dataset_name, args.dataset_name)
    _resolve_backend(args)
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.output_len
        args.prefix_repetition_output_len = args.output_len
    _validate(args)
    args.selected_metrics = parse_percentile_metrics(args.percentile_metrics)
    args.percentiles = parse_percentiles(args.metric_percentiles)
    args.goodput_slos = parse_goodput(args.goodput)
    args.extra_headers = parse_key_values(args.header, "--header")
    args.metadata_items = parse_key_values(args.metadata, "--metadata")
    sampling = {name: getattr(args, name) for name in SAMPLING_FLAGS
                if getattr(args, name) is not None}
    args.request_extra_body = {**sampling, **(args.extra_body or {})}
    return args
