"""A cap on the size of request bodies, as a pure ASGI middleware in front of the app.

FastAPI reads a whole body into memory and parses it on the event loop before any handler
runs, so without a cap a 50 MB body froze the server for tens of seconds and left gigabytes
of RSS behind. Here a body is refused with a 413 before the app sees it: at once when its
``Content-Length`` says it is too large, else (chunked, no length) as soon as the bytes read
so far pass the limit; nothing beyond the limit is ever buffered.

The refusal is sent first, then the rest of the body is read and thrown away before the
connection closes ("lingering close", as nginx does). Closing a socket with unread bytes in it
makes the kernel answer with a reset, and a reset can reach the client before it has read the
413, which it then reports as a dropped connection instead of a refusal (httpx, and so the
openai client, does: it sends the whole body before it reads the answer). The drain is bounded
in time, so a client that keeps sending cannot hold the connection open.
"""

from __future__ import annotations

import asyncio
from collections import deque
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from widellm.entrypoints.errors import APIError

CONTENT_LENGTH = b"content-length"
EXPECT = b"expect"
# How long a refused body is drained before the connection is closed regardless: 50 MB takes
# well under a second on a LAN, and nginx's default lingering_timeout is the same 5 s.
LINGER_S = 5.0


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(CONTENT_LENGTH)
        # The server (h11) has already refused a Content-Length that is not a number.
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            # A client waiting for "100 Continue" has sent no body: there is none to drain, and
            # draining would invite it (the server sends the 100 on the first receive).
            waits = headers.get(EXPECT, b"").lower() == b"100-continue"
            await self._refuse(scope, receive, send,
                               f"its Content-Length is {int(declared)} bytes, more than",
                               drain=not waits)
            return
        messages: deque[Message] = deque()
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away: let the app see it
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, "it is longer than",
                                   drain=message.get("more_body", False))
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(messages, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str,
                      drain: bool) -> None:
        err = APIError(f"request body too large: {what} this server's limit of "
                       f"{self.max_bytes} bytes (--max-request-body-bytes)",
                       HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        response = err.to_response()
        # The connection cannot carry another request: the rest of this body is not parsed.
        response.headers["connection"] = "close"
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": response.raw_headers})
        # The whole answer goes out now; the server closes the connection on the last message,
        # which waits for the drain.
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        if drain:
            try:
                await asyncio.wait_for(_discard_body(receive), LINGER_S)
            except asyncio.TimeoutError:
                pass  # the client is still sending: close on it anyway
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _discard_body(receive: Receive) -> None:
    """Read the rest of a request body, keeping none of it."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _replay(messages: deque[Message], receive: Receive) -> Receive:
    """``receive`` for the app: the body already read, then the server's own (disconnects).
    Messages are handed over, not kept, so the app alone holds the body once it has read it."""

    async def replayed() -> Message:
        if messages:
            return messages.popleft()
        return await receive()

    return replayed
