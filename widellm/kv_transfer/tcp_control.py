"""The side channel's small calls (heartbeat, release) and the connect / answer steps every
call shares, without torch: the consumer's connector uses them, and so does ``widellm proxy``
(which imports no torch) to let go of a prefill no decode instance will pull."""

from __future__ import annotations

import socket
import time
from typing import Any

from widellm.kv_transfer.stats import TransferError
from widellm.kv_transfer.wire import Receiver, send_message

# Connecting to a live producer takes well under this; a dead host is not worth more.
CONNECT_TIMEOUT_S = 5.0


def connect(params: dict[str, Any], timeout_s: float) -> socket.socket:
    """A connection to the producer ``params`` name (``remote_host``, ``remote_port``)."""
    try:
        sock = socket.create_connection((params["remote_host"], int(params["remote_port"])),
                                        timeout=min(CONNECT_TIMEOUT_S, timeout_s))
    except OSError as e:
        raise TransferError("connection", f"cannot reach the producer at "
                            f"{params['remote_host']}:{params['remote_port']}: {e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def answer(receiver: Receiver) -> dict[str, Any]:
    """The producer's reply, or its refusal as a ``TransferError`` with its cause."""
    reply = receiver.message()
    if not reply.get("ok"):
        cause = reply.get("cause", "connection")
        raise TransferError(cause if isinstance(cause, str) else "connection",
                            str(reply.get("error", "refused")))
    return reply


def _call(host: str, port: int, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    params = {"remote_host": host, "remote_port": port}
    with connect(params, timeout_s) as sock:
        try:
            send_message(sock, message)
        except OSError as e:
            raise TransferError("connection", f"request not sent: {e}") from None
        return answer(Receiver(sock, time.monotonic() + timeout_s))


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
