"""The TCP connector's framing: msgpack headers and checksummed raw payloads.

A message is a 4-byte big-endian length and a msgpack map. A payload frame is an 8-byte
length, a 4-byte crc32 and the bytes, received straight into the tensor that holds them (no
intermediate copy). Every receive runs against one deadline, so a stalled peer fails the
transfer with ``timeout`` instead of hanging it.
"""

from __future__ import annotations

import socket
import struct
import time
import zlib
from typing import Any

import msgspec

from widellm.kv_transfer.stats import TransferError

_MSG_LEN = struct.Struct("!I")
_FRAME = struct.Struct("!QI")
# A frame length no layer has: instead of a layer, a message with the cause follows (a
# streamed send that broke off after its header went out).
ERROR_FRAME_LEN = 2**64 - 1
# A header is a few hundred bytes (block id lists grow with the prompt: 8 bytes a block).
MAX_MESSAGE_BYTES = 16 << 20


def crc32(buf: memoryview) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    data = msgspec.msgpack.encode(message)
    sock.sendall(_MSG_LEN.pack(len(data)) + data)


def send_frame(sock: socket.socket, payload: memoryview, checksum: int) -> None:
    sock.sendall(_FRAME.pack(len(payload), checksum))
    sock.sendall(payload)


def send_error_frame(sock: socket.socket, cause: str, error: str) -> None:
    sock.sendall(_FRAME.pack(ERROR_FRAME_LEN, 0))
    send_message(sock, {"ok": False, "cause": cause, "error": error})


def send_partial_frame(sock: socket.socket, payload: memoryview, checksum: int) -> None:
    """A frame that announces all of ``payload`` but carries half (the short-payload fault)."""
    sock.sendall(_FRAME.pack(len(payload), checksum))
    sock.sendall(payload[: len(payload) // 2])


class Receiver:
    """Receives from ``sock`` until ``deadline`` (time.monotonic())."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TransferError("timeout", "no complete payload before the deadline")
            self.sock.settimeout(left)
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                raise TransferError("timeout", "no complete payload before the deadline"
                                    ) from None
            except OSError as e:
                raise TransferError("connection", f"receive failed: {e}") from None
            if n == 0:
                raise TransferError("short_payload",
                                    f"connection closed after {got} of {len(view)} bytes")
            got += n

    def message(self) -> dict[str, Any]:
        head = bytearray(_MSG_LEN.size)
        self.recv_into(memoryview(head))
        (length,) = _MSG_LEN.unpack(head)
        if length > MAX_MESSAGE_BYTES:
            raise TransferError("layout", f"a {length}-byte header is not a header")
        body = bytearray(length)
        self.recv_into(memoryview(body))
        try:
            message = msgspec.msgpack.decode(body)
        except msgspec.DecodeError as e:
            raise TransferError("checksum", f"undecodable header: {e}") from None
        if not isinstance(message, dict):
            raise TransferError("layout", "a header must be a map")
        return message

    def frame_into(self, out: memoryview) -> None:
        """The next payload frame into ``out``, which must be exactly its size."""
        head = bytearray(_FRAME.size)
        self.recv_into(memoryview(head))
        length, checksum = _FRAME.unpack(head)
        if length == ERROR_FRAME_LEN:
            reply = self.message()
            cause = reply.get("cause")
            raise TransferError(cause if isinstance(cause, str) else "connection",
                                f"the producer broke off: {reply.get('error', '')}")
        if length != len(out):
            raise TransferError("layout", f"a {length}-byte layer where {len(out)} were due")
        self.recv_into(out)
        if crc32(out) != checksum:
            raise TransferError("checksum", "a layer's bytes do not match their crc32")
