"""Letting go of a prefill's KV blocks that no decode instance will pull.

A prefill instance keeps a finished prompt's blocks under a lease (``lease_s``, 30 s by
default) for the decode instance to pull; a decode instance that took the request pulls
them, or releases them if the request ends first. One that never took it does neither: it
refused the request with a 4xx (the prefill's one-token request cannot show a bad
``max_tokens`` or ``min_tokens``) or a 503 (draining), or it could not be reached. Two callers
send the release then, over the prefill instance's side channel (``tcp_control``) as a
consumer would, in the background so that no client's answer waits for it; otherwise the
blocks would stay held, out of the prefill instance's pool, until the lease runs out:

- ``widellm proxy``, when no decode instance took the request (a 4xx, a 503 with no other
  instance left to try, or none reachable);
- a decode instance's own server, when it refuses a request that names a prefill (a 4xx):
  so that a router other than widellm's leaks nothing either. It leaves a 503 alone, since a
  router moves that request, with the same params, to another decode instance.

A release of blocks already released or pulled is a no-op at the producer, so both may send
one. Prefills whose params name no side channel (the file connector) are left to their
connector.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

from prometheus_client import Counter

from widellm.kv_transfer import tcp_control
from widellm.kv_transfer.stats import TransferError

logger = logging.getLogger(__name__)

# A release is one small message to a live producer; a dead one is not worth waiting on.
RELEASE_TIMEOUT_S = 2.0


class ReleaseTarget(NamedTuple):
    host: str
    port: int
    engine_id: str
    request_id: str
    streamed: bool  # request_id is a transfer id the producer may not have scheduled yet


def release_target(params: dict[str, Any]) -> ReleaseTarget | None:
    """Where the blocks ``params`` (a prefill's ``kv_transfer_params``, or the streamed flow's
    decode params) describe are held, or None when they name no side channel."""
    try:
        return ReleaseTarget(str(params["remote_host"]), int(params["remote_port"]),
                             str(params["remote_engine_id"]), str(params["remote_request_id"]),
                             params.get("transfer_id") is not None)
    except (KeyError, TypeError, ValueError):
        return None


class PrefillReleases:
    """Background releases of one proxy, counted by outcome in ``counter``."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self._tasks: set[asyncio.Task] = set()

    def start(self, params: dict[str, Any]) -> None:
        target = release_target(params)
        if target is None:
            return
        task = asyncio.create_task(self._release(target))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, t: ReleaseTarget) -> None:
        try:
            await asyncio.to_thread(tcp_control.release, t.host, t.port, t.engine_id,
                                    [t.request_id], RELEASE_TIMEOUT_S, t.streamed)
        except TransferError as e:  # the lease frees them in the end
            self.counter.labels("failed").inc()
            logger.info("releasing the KV of prefill %s at %s:%d failed: %s", t.request_id,
                        t.host, t.port, e)
            return
        self.counter.labels("released").inc()

    async def close(self) -> None:
        """Wait for the releases under way (each ends within its timeout)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
