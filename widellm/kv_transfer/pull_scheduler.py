"""The scheduler half shared by the pull-based connectors (TCP, file).

``kv_transfer_params`` a producer returns for a finished prompt (vLLM's names, plus what
lets the consumer check it got the right thing)::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "remote_engine_id": ..., "remote_host": ..., "remote_port": ...,  # from the worker half
     "remote_request_id": ..., "remote_block_ids": [...], "block_size": 16,
     "num_prompt_tokens": N, "prompt_sha256": "...", "lease_s": 30.0}

The consumer loads the prompt's first N - 1 tokens (beyond its own prefix-cache hit) and
computes the last one itself, which gives it the logits of its first output token.

Streamed transfers (the proxy's streamed flow, see ``streams.py``): the producer gets
``{"do_remote_decode": true, "transfer_id": T}`` and the consumer, at the same time,
``{"do_remote_prefill": true, "transfer_id": T, "remote_engine_id", "remote_host",
"remote_port", "block_size"}`` (the producer rank's endpoint, from its instance's
``/kv_transfer/endpoints``), with no block ids and no prompt hash: the consumer names the
blocks by their place in the prompt and the producer checks the prompt hash the consumer
sends. The producer holds such a prompt's blocks from its first step on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from widellm.kv_transfer.base import (
    KVConnectorMetadata, KVConnectorScheduler, LoadSpec, StreamSpec,
)
from widellm.kv_transfer.config import KVTransferConfig

if TYPE_CHECKING:
    from widellm.core.request import Request
    from widellm.core.scheduler_output import SchedulerOutput


def prompt_sha256(token_ids: list[int]) -> str:
    """The prompt's identity across instances (its token ids, as int64)."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()


def wants_remote_prefill(request: "Request") -> bool:
    params = request.kv_transfer_params
    return bool(params and params.get("do_remote_prefill"))


def wants_remote_decode(request: "Request") -> bool:
    params = request.kv_transfer_params
    return bool(params and params.get("do_remote_decode"))


def transfer_id(params: dict[str, Any] | None) -> str | None:
    """The streamed transfer these params name (None: a pull after the prefill)."""
    tid = params.get("transfer_id") if params else None
    return tid if isinstance(tid, str) and tid else None


class PullConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int,
                 endpoint: Callable[[], dict[str, Any]]) -> None:
        super().__init__(config, block_size)
        self.endpoint = endpoint  # the worker half's transfer_params
        self._meta = KVConnectorMetadata()
        self._streaming: set[str] = set()  # producer: streamed prompts not yet finished

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        if not (self.config.is_consumer and wants_remote_prefill(request)):
            return 0, False
        n = request.num_prompt_tokens - 1 - num_computed_tokens
        if n <= 0:  # the local prefix cache had it all: the producer may let go now
            self._release(request)
            return 0, False
        return n, True

    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        bs = self.block_size
        end_token = request.num_prompt_tokens - 1
        first = (end_token - num_external_tokens) // bs
        last = -(-end_token // bs)
        remote = list(params.get("remote_block_ids") or [])
        spec = LoadSpec(dict(params), block_ids[first:last], remote[first:last], first,
                        end_token)
        self._meta.reqs_to_load[request.request_id] = spec
        if transfer_id(params) is not None:  # the producer checks it against its prompt
            spec.params["prompt_sha256"] = prompt_sha256(request.prompt_token_ids)
        problem = self._check(request, params, last)
        if problem is not None:
            spec.params["error"] = problem

    def _check(self, request: "Request", params: dict[str, Any], num_blocks: int) -> str | None:
        """Why these params cannot serve ``request`` (a failure cause), or None."""
        if transfer_id(params) is not None:  # streamed: the producer checks the prompt
            return "layout" if params.get("block_size") != self.block_size else None
        if (params.get("num_prompt_tokens") != request.num_prompt_tokens
                or params.get("prompt_sha256") != prompt_sha256(request.prompt_token_ids)):
            return "prompt_mismatch"
        if (params.get("block_size") != self.block_size
                or len(params.get("remote_block_ids") or []) < num_blocks):
            return "layout"
        return None

    def track_remote_request(self, request: "Request") -> None:
        if self.config.is_consumer and wants_remote_prefill(request):
            self._meta.reqs_to_track[request.request_id] = dict(request.kv_transfer_params)

    def update_state_after_schedule(self, scheduler_output: "SchedulerOutput",
                                    requests: Mapping[str, "Request"]) -> None:
        if not self.config.is_producer:
            return
        so = scheduler_output
        for rid in so.preempted_req_ids & self._streaming:
            self._streaming.discard(rid)
            self._meta.reqs_to_unstream.add(rid)
        streamed = [(rid, req, tid) for rid in so.num_scheduled_tokens
                    if wants_remote_decode(req := requests[rid])
                    and (tid := transfer_id(req.kv_transfer_params)) is not None]
        if not streamed:
            return
        new_blocks = {new.req_id: new.block_ids for new in so.scheduled_new_reqs}
        new_blocks.update(zip(so.scheduled_cached_reqs.req_ids,
                              so.scheduled_cached_reqs.new_block_ids))
        for rid, req, tid in streamed:
            first_step = rid not in self._streaming
            self._streaming.add(rid)
            spec = StreamSpec(tid, list(new_blocks.get(rid, [])),
                              prompt_sha256(req.prompt_token_ids) if first_step else "",
                              req.num_prompt_tokens)
            if (old := self._meta.reqs_to_stream.get(rid)) is not None:  # two steps in one
                spec.new_block_ids = old.new_block_ids + spec.new_block_ids
                spec.prompt_sha256 = old.prompt_sha256 or spec.prompt_sha256
            self._meta.reqs_to_stream[rid] = spec
            so.kv_stream_tokens[rid] = min(req.num_computed_tokens, req.num_prompt_tokens)

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if wants_remote_prefill(request):  # a consumer's request ended before it loaded
            self._release(request)
            return False, None
        streamed = request.request_id in self._streaming
        self._streaming.discard(request.request_id)
        if not (self.config.is_producer and wants_remote_decode(request) and block_ids):
            if streamed:
                self._meta.reqs_to_unstream.add(request.request_id)
            return False, None
        if request.status.finish_reason not in ("stop", "length"):
            if streamed:  # its blocks are freed now: a send of them must stop
                self._meta.reqs_to_unstream.add(request.request_id)
            return False, None  # aborted: nobody will pull it
        self._meta.reqs_to_hold[request.request_id] = list(block_ids)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, **self.endpoint(),
            "remote_request_id": request.request_id, "remote_block_ids": list(block_ids),
            "block_size": self.block_size, "num_prompt_tokens": request.num_prompt_tokens,
            "prompt_sha256": prompt_sha256(request.prompt_token_ids),
        }

    def _release(self, request: "Request") -> None:
        self._meta.reqs_to_release[request.request_id] = dict(request.kv_transfer_params)
        self._meta.reqs_to_track.pop(request.request_id, None)
        request.kv_transfer_params = None
