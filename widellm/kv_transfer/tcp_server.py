"""The producer's side channel: a TCP server that serves pulls, heartbeats and releases.

One thread accepts; each connection is served on a thread of a bounded pool. A pull is
``{"op": "pull", "engine_id", "request_id", "block_ids"}``; the answer is a header
(``{"ok": true, "layout": ...}`` or ``{"ok": false, "cause", "error"}``) and then one
checksummed frame per layer, gathered from the cache as it goes, and the consumer's one-byte
acknowledgement. Whatever happens, the hold ends with the pull: the consumer never pulls twice.

A streamed pull, ``{"op": "pull_stream", "engine_id", "transfer_id", "first_block",
"num_blocks", "num_tokens", "prompt_sha256"}``, may come before the prompt is even scheduled
here: it waits for the prompt (``transfer_timeout_s``), checks the prompt hash, and sends layer
L once the forward wrote its first ``num_tokens`` tokens there (each layer may take up to
``transfer_timeout_s`` more), re-checking after each gather that the prompt was not aborted or
preempted meanwhile (its blocks could then hold another request's KV).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from widellm.kv_transfer import faults
from widellm.kv_transfer.holds import HoldTable
from widellm.kv_transfer.kv_layout import describe, gather_blocks
from widellm.kv_transfer.stats import TransferError
from widellm.kv_transfer.streams import Stream, StreamTable
from widellm.kv_transfer.wire import (
    Receiver, crc32, send_error_frame, send_frame, send_message, send_partial_frame,
)

logger = logging.getLogger(__name__)

# Connections served at once; more wait in the listen backlog.
MAX_CONNECTIONS = 16
# A request message must arrive this soon after connecting.
REQUEST_READ_TIMEOUT_S = 10.0
ACCEPT_POLL_S = 0.5


class SideChannelServer:
    def __init__(self, host: str, port: int, engine_id: str, holds: HoldTable,
                 caches: Callable[[], tuple[list[torch.Tensor], list[int]]],
                 on_sent: Callable[[int, float, str | None], None],
                 send_timeout_s: float, streams: StreamTable | None = None) -> None:
        self.engine_id = engine_id
        self.streams = streams if streams is not None else StreamTable()
        self.holds = holds
        self.caches = caches
        self.on_sent = on_sent
        self.send_timeout_s = send_timeout_s
        self.sock = socket.create_server((host, port))
        self.sock.settimeout(ACCEPT_POLL_S)
        self.host, self.port = host, self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(MAX_CONNECTIONS, thread_name_prefix="widellm-kv-send")
        self._thread = threading.Thread(target=self._accept_loop, name="widellm-kv-accept",
                                        daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            self._pool.submit(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                msg = Receiver(conn, time.monotonic() + REQUEST_READ_TIMEOUT_S).message()
                op = msg.get("op")
                if msg.get("engine_id") != self.engine_id:
                    send_message(conn, {"ok": False, "cause": "engine_mismatch",
                                        "error": f"this is engine {self.engine_id}"})
                elif op == "pull":
                    self._pull(conn, str(msg["request_id"]), list(msg["block_ids"]))
                elif op == "pull_stream":
                    self._pull_stream(conn, msg)
                elif op == "heartbeat":
                    ids = [str(r) for r in msg["request_ids"]]
                    unknown = self.holds.heartbeat([self.streams.resolve(r) for r in ids])
                    names = dict(zip((self.streams.resolve(r) for r in ids), ids))
                    send_message(conn, {"ok": True, "unknown": [names[u] for u in unknown]})
                elif op == "release":
                    for ident in map(str, msg["request_ids"]):
                        if msg.get("streamed") and not self.streams.is_known(ident):
                            self.streams.release_early(ident)  # not scheduled here yet
                        self.holds.release([self.streams.resolve(ident)])
                    send_message(conn, {"ok": True})
                else:
                    send_message(conn, {"ok": False, "cause": "layout",
                                        "error": f"unknown op {op!r}"})
            except (OSError, TransferError, KeyError, TypeError, ValueError) as e:
                logger.warning("KV side channel: a connection failed: %s", e)

    def _pull(self, conn: socket.socket, request_id: str, block_ids: list[int]) -> None:
        refused = self.holds.begin_send(request_id, block_ids)
        if refused is not None:
            send_message(conn, {"ok": False, "cause": refused,
                                "error": f"request {request_id!r} cannot be pulled"})
            return
        ids = torch.tensor(block_ids, dtype=torch.int64)
        self._send(conn, request_id, request_id,
                   lambda layer, cache, dim: gather_blocks(cache, dim, ids))

    def _pull_stream(self, conn: socket.socket, msg: dict) -> None:
        tid, first, num = str(msg["transfer_id"]), int(msg["first_block"]), int(msg["num_blocks"])
        num_tokens = int(msg["num_tokens"])
        try:
            stream = self.streams.wait_stream(tid, time.monotonic() + self.send_timeout_s)
        except TransferError as e:
            send_message(conn, {"ok": False, "cause": e.cause, "error": str(e)})
            return
        problem = None
        if stream.prompt_sha256 != msg.get("prompt_sha256"):
            problem = "prompt_mismatch", "the transfer was made for another prompt"
        elif num_tokens > stream.num_prompt_tokens or first < 0 or num < 0:
            problem = "layout", (f"{num_tokens} tokens asked of a "
                                 f"{stream.num_prompt_tokens}-token prompt")
        elif (refused := self.holds.begin_send(stream.request_id, None)) is not None:
            problem = refused, f"transfer {tid!r} cannot be pulled"
        if problem is not None:
            send_message(conn, {"ok": False, "cause": problem[0], "error": problem[1]})
            return

        def layer_bytes(layer: int, cache: torch.Tensor, dim: int) -> torch.Tensor:
            self.streams.wait_layer(stream, layer, num_tokens,
                                    time.monotonic() + self.send_timeout_s)
            return self._gather_streamed(stream, cache, dim, first, num)

        self._send(conn, stream.request_id, tid, layer_bytes)

    def _send(self, conn: socket.socket, request_id: str, name: str,
              layer_bytes: Callable[[int, torch.Tensor, int], torch.Tensor]) -> None:
        """The answer to a pull whose hold is claimed: the header, one frame per layer
        (``layer_bytes(layer, cache, block_dim)``), the consumer's acknowledgement; the
        claim ends whatever happens."""
        start, cause, num_bytes = time.perf_counter(), None, 0
        try:
            caches, dims = self.caches()
            send_message(conn, {"ok": True, "layout": describe(caches, dims)})
            fault, arg = faults.current_fault()
            if fault == "stall":
                time.sleep(arg)
            conn.settimeout(self.send_timeout_s)
            for layer, (cache, dim) in enumerate(zip(caches, dims)):
                sent = _send_layer(conn, layer_bytes(layer, cache, dim),
                                   fault if layer == len(caches) // 2 else "")
                if sent is None:
                    return
                num_bytes += sent
            Receiver(conn, time.monotonic() + self.send_timeout_s).recv_into(
                memoryview(bytearray(1)))  # the consumer's acknowledgement
        except (OSError, TransferError) as e:
            cause = e.cause if isinstance(e, TransferError) else "connection"
            logger.warning("KV send of %s broke off (%s): %s", name, cause, e)
            if isinstance(e, TransferError):  # tell the consumer why, if it still listens
                with contextlib.suppress(OSError):
                    send_error_frame(conn, cause, str(e))
        finally:
            self.holds.end_send(request_id)
            self.on_sent(num_bytes, time.perf_counter() - start, cause)

    def _gather_streamed(self, stream: Stream, cache: torch.Tensor, dim: int, first: int,
                         num: int) -> torch.Tensor:
        """One layer's bytes of blocks ``first``.. of a streamed prompt (its blocks now)."""
        held = self.holds.block_ids(stream.request_id) or []
        if len(held) < first + num:
            raise TransferError("layout", f"blocks {first}..{first + num} asked, "
                                f"{len(held)} held")
        data = gather_blocks(cache, dim, torch.tensor(held[first:first + num], dtype=torch.int64))
        if self.streams.is_broken(stream):  # the blocks may have been rewritten mid-gather
            raise TransferError("unknown_request", "the prompt was aborted or preempted on "
                                "the prefill instance")
        return data

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _send_layer(conn: socket.socket, data: torch.Tensor, fault: str) -> int | None:
    """One layer's bytes as a checksummed frame; returns the bytes sent, or None when the
    test ``fault`` (set for one layer) cut the transfer short."""
    view = memoryview(data.numpy())
    checksum = crc32(view)
    if fault == "corrupt":
        data[0] ^= 0xFF  # after the checksum: what a bad link or NIC would do
    if fault in ("short", "exit_mid_transfer"):
        send_partial_frame(conn, view, checksum)
        if fault == "exit_mid_transfer":
            os._exit(1)  # the instance dies mid-transfer, as under SIGKILL
        return None
    send_frame(conn, view, checksum)
    return len(view)
