"""The consumer's side of the TCP connector: pull a request's blocks (heartbeats and releases
are ``tcp_control``'s)."""

from __future__ import annotations

import time
from typing import Any

import torch

from widellm.kv_transfer.kv_layout import describe, layer_nbytes, scatter_blocks
from widellm.kv_transfer.stats import TransferError
from widellm.kv_transfer.tcp_control import answer, connect
from widellm.kv_transfer.wire import Receiver, send_message


def pull(params: dict[str, Any], remote_block_ids: list[int], local_block_ids: list[int],
         caches: list[torch.Tensor], block_dims: list[int], timeout_s: float) -> int:
    """Load the producer's ``remote_block_ids`` into ``local_block_ids`` of every layer, each
    layer written only once its checksum matched; returns the payload bytes received."""
    deadline = time.monotonic() + timeout_s
    local = torch.tensor(local_block_ids, dtype=torch.int64)
    with connect(params, timeout_s) as sock:
        try:
            send_message(sock, {"op": "pull", "engine_id": params["remote_engine_id"],
                                "request_id": params["remote_request_id"],
                                "block_ids": remote_block_ids})
        except OSError as e:
            raise TransferError("connection", f"request not sent: {e}") from None
        return _receive_layers(Receiver(sock, deadline), caches, block_dims, local, None)


def pull_stream(params: dict[str, Any], first_block: int, num_tokens: int,
                local_block_ids: list[int], caches: list[torch.Tensor], block_dims: list[int],
                timeout_s: float) -> int:
    """A streamed pull (``params`` name a ``transfer_id``): the producer's blocks
    ``first_block`` onwards of the prompt, into ``local_block_ids``, each layer as soon as the
    producer wrote its first ``num_tokens`` tokens; ``timeout_s`` bounds each wait (for the
    prompt to be scheduled there, then for each layer). Returns the payload bytes."""
    local = torch.tensor(local_block_ids, dtype=torch.int64)
    with connect(params, timeout_s) as sock:
        try:
            send_message(sock, {
                "op": "pull_stream", "engine_id": params["remote_engine_id"],
                "transfer_id": params["transfer_id"], "first_block": first_block,
                "num_blocks": len(local_block_ids), "num_tokens": num_tokens,
                "prompt_sha256": params["prompt_sha256"]})
        except OSError as e:
            raise TransferError("connection", f"request not sent: {e}") from None
        # The producer waits up to timeout_s for the prompt, then for each layer: it answers
        # (a layer, or why not) within that; twice that here is for the send itself.
        wait_s = 2 * timeout_s
        return _receive_layers(Receiver(sock, time.monotonic() + wait_s), caches, block_dims,
                               local, wait_s)


def _receive_layers(receiver: Receiver, caches: list[torch.Tensor], block_dims: list[int],
                    local: torch.Tensor, per_layer_s: float | None) -> int:
    """The header, then one frame per layer written into blocks ``local`` (each only once its
    checksum matched), then the acknowledgement; ``per_layer_s`` gives each layer its own
    deadline (a streamed pull) instead of the receiver's one for all."""
    reply = answer(receiver)
    if reply.get("layout") != describe(caches, block_dims):
        raise TransferError("layout", "the producer's KV cache layout differs from ours")
    total = 0
    for cache, dim in zip(caches, block_dims):
        staging = torch.empty(layer_nbytes(cache, dim, len(local)), dtype=torch.uint8)
        if per_layer_s is not None:
            receiver.deadline = time.monotonic() + per_layer_s
        receiver.frame_into(memoryview(staging.numpy()))
        scatter_blocks(cache, dim, local, staging)
        total += staging.numel()
    try:
        receiver.sock.sendall(b"\x01")
    except OSError:
        pass  # everything arrived; the producer ends the hold either way
    return total
