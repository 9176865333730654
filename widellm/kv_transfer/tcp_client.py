"""The consumer's side of the TCP connector: pull a request's blocks, heartbeat, release."""

from __future__ import annotations

import socket
import time
from typing import Any

import torch

from widellm.kv_transfer.kv_layout import describe, layer_nbytes, scatter_blocks
from widellm.kv_transfer.stats import TransferError
from widellm.kv_transfer.wire import Receiver, send_message

# Connecting to a live producer takes well under this; a dead host is not worth more.
CONNECT_TIMEOUT_S = 5.0


def _connect(params: dict[str, Any], timeout_s: float) -> socket.socket:
    try:
        sock = socket.create_connection((params["remote_host"], int(params["remote_port"])),
                                        timeout=min(CONNECT_TIMEOUT_S, timeout_s))
    except OSError as e:
        raise TransferError("connection", f"cannot reach the producer at "
                            f"{params['remote_host']}:{params['remote_port']}: {e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _answer(receiver: Receiver) -> dict[str, Any]:
    reply = receiver.message()
    if not reply.get("ok"):
        cause = reply.get("cause", "connection")
        raise TransferError(cause if isinstance(cause, str) else "connection",
                            str(reply.get("error", "refused")))
    return reply


def pull(params: dict[str, Any], remote_block_ids: list[int], local_block_ids: list[int],
         caches: list[torch.Tensor], block_dims: list[int], timeout_s: float) -> int:
    """Load the producer's ``remote_block_ids`` into ``local_block_ids`` of every layer, each
    layer written only once its checksum matched; returns the payload bytes received."""
    deadline = time.monotonic() + timeout_s
    local = torch.tensor(local_block_ids, dtype=torch.int64)
    with _connect(params, timeout_s) as sock:
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
    with _connect(params, timeout_s) as sock:
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
    reply = _answer(receiver)
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


def _call(host: str, port: int, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    params = {"remote_host": host, "remote_port": port}
    with _connect(params, timeout_s) as sock:
        try:
            send_message(sock, message)
        except OSError as e:
            raise TransferError("connection", f"request not sent: {e}") from None
        return _answer(Receiver(sock, time.monotonic() + timeout_s))


def heartbeat(host: str, port: int, engine_id: str, request_ids: list[str],
              timeout_s: float) -> list[str]:
    """Extend the producer's leases; returns the ids it no longer holds."""
    reply = _call(host, port, {"op": "heartbeat", "engine_id": engine_id,
                               "request_ids": request_ids}, timeout_s)
    return [str(r) for r in reply.get("unknown", [])]


def release(host: str, port: int, engine_id: str, request_ids: list[str],
            timeout_s: float, streamed: bool = False) -> None:
    """Let go of these holds; ``streamed``: the ids are transfer ids, which the producer
    may not have scheduled yet (it then remembers to let go once it has)."""
    _call(host, port, {"op": "release", "engine_id": engine_id, "request_ids": request_ids,
                       "streamed": streamed}, timeout_s)
