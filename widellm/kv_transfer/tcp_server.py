"""The producer's side channel: a TCP server that serves pulls, heartbeats and releases.

One thread accepts; each connection is served on a thread of a bounded pool. A pull is
``{"op": "pull", "engine_id", "request_id", "block_ids"}``; the answer is a header
(``{"ok": true, "layout": ...}`` or ``{"ok": false, "cause", "error"}``) and then one
checksummed frame per layer, gathered from the cache as it goes, and the consumer's one-byte
acknowledgement. Whatever happens, the hold ends with the pull: the consumer never pulls twice.
"""

from __future__ import annotations

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
from widellm.kv_transfer.wire import (
    Receiver, crc32, send_frame, send_message, send_partial_frame,
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
                 send_timeout_s: float) -> None:
        self.engine_id = engine_id
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
                elif op == "heartbeat":
                    unknown = self.holds.heartbeat([str(r) for r in msg["request_ids"]])
                    send_message(conn, {"ok": True, "unknown": unknown})
                elif op == "release":
                    self.holds.release([str(r) for r in msg["request_ids"]])
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
        start, cause, num_bytes = time.perf_counter(), None, 0
        try:
            caches, dims = self.caches()
            send_message(conn, {"ok": True, "layout": describe(caches, dims)})
            fault, arg = faults.current_fault()
            if fault == "stall":
                time.sleep(arg)
            ids = torch.tensor(block_ids, dtype=torch.int64)
            conn.settimeout(self.send_timeout_s)
            for i, (cache, dim) in enumerate(zip(caches, dims)):
                data = gather_blocks(cache, dim, ids)
                view = memoryview(data.numpy())
                checksum = crc32(view)
                if fault == "corrupt" and i == len(caches) // 2:
                    data[0] ^= 0xFF  # after the checksum: what a bad link or NIC would do
                if i == len(caches) // 2 and fault in ("short", "exit_mid_transfer"):
                    send_partial_frame(conn, view, checksum)
                    if fault == "exit_mid_transfer":
                        os._exit(1)  # the instance dies mid-transfer, as under SIGKILL
                    return
                send_frame(conn, view, checksum)
                num_bytes += len(view)
            Receiver(conn, time.monotonic() + self.send_timeout_s).recv_into(
                memoryview(bytearray(1)))  # the consumer's acknowledgement
        except (OSError, TransferError) as e:
            cause = e.cause if isinstance(e, TransferError) else "connection"
            logger.warning("KV send of %s broke off (%s): %s", request_id, cause, e)
        finally:
            self.holds.end_send(request_id)
            self.on_sent(num_bytes, time.perf_counter() - start, cause)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)
