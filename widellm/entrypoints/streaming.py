"""Request lifetimes over HTTP: server-sent events, merging the streams of several engine
requests, and making sure a client that goes away aborts its engine requests at once.

Aborting happens by closing (or cancelling) the ``AsyncLLM.generate`` iterators: their
``finally`` tells the engine core to drop the request and free its KV blocks. Nothing here
relies on the garbage collector to close an abandoned iterator.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Send

from widellm.entrypoints.errors import to_api_error

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_MEDIA_TYPE = "text/event-stream"
SSE_DONE = "data: [DONE]\n\n"
# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25
# nginx's status for "client closed the request"; nobody reads it, it only shows in logs.
CLIENT_CLOSED_REQUEST = 499


def sse_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


async def sse_frames(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """SSE frames for ``chunks`` and the closing ``[DONE]``. A failure after the response has
    started (the engine died, say) can no longer change the status, so it becomes an
    ``data: {"error": ...}`` event before ``[DONE]``."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield sse_event(chunk)
    except Exception as e:  # noqa: BLE001 -- reported to the client, not swallowed
        err = to_api_error(e)
        logger.error("stream failed: %s", err.message)
        yield sse_event(err.to_model())
    yield SSE_DONE


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator however the response ends.

    Starlette cancels the sending task when the client disconnects; if that lands while the
    task waits on the socket rather than on the iterator, the iterator would stay suspended
    and its engine requests would keep generating. Closing it here aborts them at once.
    """

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            # Shielded: the surrounding scope may already be cancelled (client gone).
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def sse_response(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
    return ClosingStreamingResponse(sse_frames(chunks), media_type=SSE_MEDIA_TYPE)


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException


_DONE = object()


async def merge_async_iterators(
    iterators: list[AsyncIterator[T]],
) -> AsyncIterator[tuple[int, T]]:
    """Items of all ``iterators`` as they arrive, tagged with the iterator's index. The first
    failure is raised; closing the merged iterator cancels (and so aborts) the rest."""
    if len(iterators) == 1:  # the common case needs no tasks
        async with aclosing(iterators[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                queue.put_nowait((index, item))
        except Exception as e:  # noqa: BLE001 -- handed to the consumer
            queue.put_nowait((index, _Failed(e)))
            return
        queue.put_nowait((index, _DONE))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # a cancelled generate() aborts its engine request
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_unless_disconnected(
    work: Awaitable[Any], request: Request, poll_s: float = DISCONNECT_POLL_S,
) -> tuple[bool, Any]:
    """Await ``work`` unless the client disconnects first, in which case it is cancelled.
    Returns ``(True, result)`` or ``(False, None)``; exceptions of ``work`` propagate."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return True, task.result()
            if await request.is_disconnected():
                logger.info("client disconnected; aborting its request")
                return False, None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def client_closed_response() -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)
