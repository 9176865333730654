"""A cap on the size of request bodies, as a pure ASGI middleware in front of the app.

FastAPI reads a whole body into memory and parses it on the event loop before any handler
runs, so without a cap a 50 MB body froze the server for tens of seconds and left gigabytes
of RSS behind. Here a body is refused with a 413 before the app sees it: at once when its
``Content-Length`` says it is too large, else (chunked, no length) as soon as the bytes read
so far pass the limit; nothing beyond the limit is ever buffered.
"""

from __future__ import annotations

from collections import deque
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from widellm.entrypoints.errors import APIError

CONTENT_LENGTH = b"content-length"


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(CONTENT_LENGTH)
        # The server (h11) has already refused a Content-Length that is not a number.
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send,
                               f"its Content-Length is {int(declared)} bytes, more than")
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
                await self._refuse(scope, receive, send, "it is longer than")
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(messages, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        err = APIError(f"request body too large: {what} this server's limit of "
                       f"{self.max_bytes} bytes (--max-request-body-bytes)",
                       HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        response = err.to_response()
        # The rest of the body is never read, so the connection cannot carry another request.
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _replay(messages: deque[Message], receive: Receive) -> Receive:
    """``receive`` for the app: the body already read, then the server's own (disconnects).
    Messages are handed over, not kept, so the app alone holds the body once it has read it."""

    async def replayed() -> Message:
        if messages:
            return messages.popleft()
        return await receive()

    return replayed
