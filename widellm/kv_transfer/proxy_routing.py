"""Routing for ``widellm proxy``: which prefill (or decode) instance gets a request, what
each is sent, and the counters kept about it.

Pure (no I/O, an injectable clock; stdlib and prometheus_client only) so that the policy is
unit-tested on its own and so that the CLI builds the proxy's flags without importing
FastAPI or httpx.

The policy, per pool: send a request where its prompt's prefix was sent before (that
instance likely still holds those KV blocks in its prefix cache, so its prefill is shorter),
unless that instance is busier than the least loaded one by more than ``max_load_imbalance``
requests (affinity must not pile every request sharing a system prompt on one instance).
The proxy cannot see the instances' caches, so it remembers, per instance, the block keys of
the prompts it sent there: a chain of hashes over fixed-size chunks of the prompt text, as a
prefix cache chains block hashes over token ids (the proxy has no tokenizer).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Characters of prompt text per block key: short enough that prompts sharing a few hundred
# characters (a system prompt) match, long enough that a 100k-character prompt makes only a
# few hundred keys to hash and look up.
PREFIX_BLOCK_CHARS = 256
# Keys remembered per instance (least recently used go first): about 25M characters of
# distinct prompt text, ~4 MB of digests, which outlives any instance's prefix cache.
MAX_KEYS_PER_INSTANCE = 100_000
# How long an instance whose connection failed is passed over (unless all are).
UNHEALTHY_COOLDOWN_S = 5.0
# In-flight requests by which the prefix-affine instance may exceed the least loaded one.
DEFAULT_MAX_LOAD_IMBALANCE = 4
# Backend call limits (flags): generation can take minutes; a connection should not.
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_PROXY_HOST = "127.0.0.1"
DEFAULT_PROXY_PORT = 8000
API_KEY_ENV = "WIDELLM_API_KEY"
# What the prefill instance is told: compute the prompt and keep its blocks for a remote
# decode to pull, rather than generating itself.
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
# Backend call durations, from a cached prefill to a long generation.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                    600.0)
# The root of the key chain (a prefix cache's "no parent" hash).
_ROOT_KEY = b""


def prompt_text(body: dict[str, Any], chat: bool) -> str:
    """The part of a request that its KV cache depends on, as one canonical string.

    Completions: ``prompt`` as sent (a string, or JSON of a token id list / prompt list).
    Chat: JSON of ``messages`` with sorted keys, so key order in the client's JSON does not
    change the keys (the chat template renders the same prompt either way).
    """
    value = body.get("messages") if chat else body.get("prompt")
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):  # not JSON-able: no affinity, routing still works
        return ""


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The client's request as the prefill instance gets it: one token, one sample, not
    streamed, asked to keep its KV blocks for a remote decode."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    out["stream"] = False
    out.pop("stream_options", None)  # only valid with stream true
    out.pop("min_tokens", None)  # min_tokens > max_tokens would be refused as a bad request
    out["n"] = 1
    if chat and "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    if not chat or "max_tokens" in body or "max_completion_tokens" not in body:
        out["max_tokens"] = 1
    return out


def skips_disaggregation(body: dict[str, Any]) -> bool:
    """Requests for several sequences go straight to a decode instance, which prefills them
    itself: the n (or best_of) samples, or the prompts of a batch, would each pull the same
    or their own remote blocks, and one prefill's ``kv_transfer_params`` (one lease on one
    prompt's blocks) cannot serve several sequences. So do requests for the prompt's own
    logprobs (``echo`` with ``logprobs``, ``prompt_logprobs``): only the instance that
    computes the prompt has its logits."""
    if body.get("prompt_logprobs") is not None or (
            body.get("echo") and body.get("logprobs") is not None):
        return True
    for field in ("n", "best_of"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return True
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)


def block_keys(text: str, block_chars: int = PREFIX_BLOCK_CHARS) -> list[bytes]:
    """Chained keys of ``text``'s chunks: key i = sha256(key i-1 + chunk i), so equal keys mean
    equal text up to and including that chunk. The last, partial chunk gets a key too (two
    requests with the same short prompt then match)."""
    keys: list[bytes] = []
    parent = _ROOT_KEY
    for start in range(0, len(text), block_chars):
        chunk = text[start:start + block_chars].encode("utf-8", "surrogatepass")
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys


class InstancePool:
    """One pool (prefill or decode) of backend URLs: in-flight counts, remembered prefix keys,
    health. Used from one event loop only, so it takes no locks."""

    def __init__(self, urls: Sequence[str],
                 max_load_imbalance: int = DEFAULT_MAX_LOAD_IMBALANCE,
                 max_keys: int = MAX_KEYS_PER_INSTANCE,
                 cooldown_s: float = UNHEALTHY_COOLDOWN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not urls:
            raise ValueError("an instance pool needs at least one URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_load_imbalance = max_load_imbalance
        self.in_flight = [0] * len(self.urls)
        self._max_keys = max_keys
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._seen: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in self.urls]
        self._unhealthy_until = [float("-inf")] * len(self.urls)
        self._next = 0  # round-robin cursor: ties go to the first index at or after it

    def __len__(self) -> int:
        return len(self.urls)

    def is_healthy(self, index: int) -> bool:
        return self._clock() >= self._unhealthy_until[index]

    def mark_failed(self, index: int) -> None:
        """A connection to ``index`` failed: pass it over for the cooldown."""
        self._unhealthy_until[index] = self._clock() + self._cooldown_s

    def mark_ok(self, index: int) -> None:
        self._unhealthy_until[index] = float("-inf")

    def matched_blocks(self, index: int, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, ``index`` has seen (a chain breaks at the
        first miss: later blocks depend on it)."""
        seen = self._seen[index]
        matched = 0
        for key in keys:
            if key not in seen:
                break
            matched += 1
        return matched

    def choose(self, keys: Sequence[bytes], exclude: Iterable[int] = ()) -> int | None:
        """The instance for a request with prompt ``keys``, none of ``exclude`` (those already
        tried); None when every instance is excluded.

        Healthy instances only, unless none is. Among those whose load is within
        ``max_load_imbalance`` of the least loaded one: most matched leading blocks, then
        least loaded, then round-robin order. So when the best-matching instance is too busy
        the next best-matching one that is not gets it (the least loaded if none matches).
        """
        excluded = set(exclude)
        candidates = [i for i in range(len(self.urls)) if i not in excluded]
        if not candidates:
            return None
        candidates = [i for i in candidates if self.is_healthy(i)] or candidates
        least = min(self.in_flight[i] for i in candidates)
        eligible = [i for i in candidates if self.in_flight[i] - least <= self.max_load_imbalance]
        n = len(self.urls)
        pick = min(eligible, key=lambda i: (-self.matched_blocks(i, keys), self.in_flight[i],
                                            (i - self._next) % n))
        self._next = (pick + 1) % n
        return pick

    def record(self, index: int, keys: Sequence[bytes]) -> None:
        """``index`` was sent a prompt with ``keys``: remember them (most recent last)."""
        seen = self._seen[index]
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self._max_keys:
            seen.popitem(last=False)

    def acquire(self, index: int) -> None:
        self.in_flight[index] += 1

    def release(self, index: int) -> None:
        self.in_flight[index] -= 1


class ProxyMetrics:
    """The proxy's Prometheus series, in a registry of its own (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "widellm:proxy_requests", "Backend calls by answer (HTTP status, or 'error' when "
            "none came)", ["pool", "instance", "status"], registry=r)
        self.in_flight = Gauge(
            "widellm:proxy_requests_in_flight", "Backend calls not finished yet",
            ["pool", "instance"], registry=r)
        self.prefill_fallbacks = Counter(
            "widellm:proxy_prefill_fallbacks", "Times a request moved on to the next prefill "
            "instance after one failed", registry=r)
        self.prefill_releases = Counter(
            "widellm:proxy_prefill_releases", "Prefills whose held KV blocks the proxy let go "
            "because no decode instance took the request, by outcome", ["outcome"],
            registry=r)
        self.streamed = Counter(
            "widellm:proxy_streamed_transfers", "Requests sent to a prefill and a decode "
            "instance at once (--kv-transfer-mode streamed)", registry=r)
        self.duration = Histogram(
            "widellm:proxy_request_duration_seconds", "Backend call duration (a stream: to "
            "its last byte)", ["pool"], buckets=DURATION_BUCKETS, registry=r)


class BackendCall:
    """One call to ``pool``'s instance ``index``: counted in flight (by the routing and the
    gauge) from creation to ``finish``, then counted by its answer and timed."""

    def __init__(self, pool: InstancePool, metrics: ProxyMetrics, pool_name: str,
                 index: int) -> None:
        self._pool, self._metrics, self._pool_name, self._index = pool, metrics, pool_name, index
        self._instance = pool.urls[index]
        self._start, self._done = time.monotonic(), False
        pool.acquire(index)
        metrics.in_flight.labels(pool_name, self._instance).inc()

    def finish(self, status: int | str) -> None:
        """Once only: later calls (a stream's cleanup after an error) do nothing."""
        if self._done:
            return
        self._done, m = True, self._metrics
        self._pool.release(self._index)
        m.in_flight.labels(self._pool_name, self._instance).dec()
        m.requests.labels(self._pool_name, self._instance, str(status)).inc()
        m.duration.labels(self._pool_name).observe(time.monotonic() - self._start)


def _non_negative(kind: type) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        number = kind(value)
        if not number >= 0:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
        return number
    return parse


def add_proxy_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``widellm proxy`` (here, beside the defaults they expose, so that
    building the CLI parser imports no FastAPI/httpx)."""
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="prefill instances (widellm serve with KV transfer), e.g. "
                             "http://10.0.0.1:8000")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="decode instances")
    parser.add_argument("--host", type=str, default=DEFAULT_PROXY_HOST,
                        help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=DEFAULT_PROXY_PORT,
                        help="port to listen on (0: any free port)")
    parser.add_argument("--api-key", type=str, default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: "
                             f"${API_KEY_ENV}); the header is forwarded to the backends")
    parser.add_argument("--max-load-imbalance", type=_non_negative(int),
                        default=DEFAULT_MAX_LOAD_IMBALANCE,
                        help="in-flight requests by which the instance holding a request's "
                             "prefix may exceed the least loaded one before the least loaded "
                             "one is used instead (default %(default)s)")
    parser.add_argument("--request-timeout-s", type=_non_negative(float),
                        default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="seconds a backend may take to answer or between streamed "
                             "chunks; 0: no limit (default %(default)s)")
    parser.add_argument("--connect-timeout-s", type=_non_negative(float),
                        default=DEFAULT_CONNECT_TIMEOUT_S,
                        help="seconds to connect to a backend; 0: no limit (default "
                             "%(default)s)")
    parser.add_argument("--kv-transfer-mode", choices=["sequential", "streamed"],
                        default="sequential",
                        help="sequential: the decode request is sent once the prefill "
                             "answered, and pulls the finished prompt's KV; streamed: both "
                             "at once, the prefill instance sending each layer's KV as soon "
                             "as it is computed (needs TCPConnector on both sides; default "
                             "%(default)s)")
    parser.add_argument("--uvicorn-log-level", type=str, default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
