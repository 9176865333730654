"""The proxy's streamed flow: prefill and decode sent at once, the KV streamed layer by layer.

The sequential flow (``proxy.py``) sends the decode request once the prefill answered, so
the decode instance starts pulling only when the whole prompt is computed. In the streamed
flow (``widellm proxy --kv-transfer-mode streamed``) the proxy picks a prefill instance and
one of its data-parallel ranks (from the instance's ``/kv_transfer/endpoints``), makes a
``transfer_id``, and sends both requests at once: the prefill pinned to that rank
(``X-data-parallel-rank``) with ``{"do_remote_decode": true, "transfer_id": T}``, the decode
with that rank's endpoint and T. The decode instance pulls at once and the prefill instance
sends each layer as soon as its forward wrote it (``streams.py``), so the transfer overlaps
the prefill (SGLang's bootstrap flow, on vLLM's ``kv_transfer_params``).

A prefill instance without streamed transfers (FileConnector), or whose endpoints cannot be
read, gets the sequential flow. A prefill that fails after the decode was sent fails the
decode's pull, which then follows the decode instance's ``kv_load_failure_policy``
(``recompute``: it computes the prompt itself; ``fail``: an error to the client).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import Any

import httpx

from widellm.kv_transfer.proxy_routing import BackendCall, InstancePool, ProxyMetrics, prefill_body

logger = logging.getLogger(__name__)

ENDPOINTS_PATH = "/kv_transfer/endpoints"
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"
# A restarted prefill instance has new engine ids: pulls made with the old ones fail (and
# drop the cache at once); this bounds how long a quiet proxy keeps stale ones.
ENDPOINTS_TTL_S = 10.0
ENDPOINTS_TIMEOUT_S = 2.0
PREFILL = "prefill"


class StreamedFlow:
    """Starts streamed prefills; the caller sends the decode with the params returned."""

    def __init__(self, pool: InstancePool, metrics: ProxyMetrics) -> None:
        self.pool, self.metrics = pool, metrics
        self.client: httpx.AsyncClient | None = None  # the proxy's, set by its lifespan
        self._endpoints: dict[str, tuple[float, dict[str, Any] | None]] = {}
        self._next_rank: dict[str, itertools.count] = {}
        self._tasks: set[asyncio.Task] = set()

    async def start(self, path: str, body: dict[str, Any], chat: bool, keys: list[bytes],
                    headers: dict[str, str]) -> dict[str, Any] | None:
        """Send the prefill (in the background) and return the decode's
        ``kv_transfer_params``; None when no prefill instance can stream this request."""
        index = self.pool.choose(keys)
        if index is None:
            return None
        url = self.pool.urls[index]
        info = await self._info(url, headers)
        if info is None or not info.get("streams") or not info.get("ranks"):
            return None
        ranks = info["ranks"]
        rank = ranks[next(self._next_rank.setdefault(url, itertools.count())) % len(ranks)]
        tid = uuid.uuid4().hex
        pbody = prefill_body(body, chat)
        pbody["kv_transfer_params"] = {**pbody["kv_transfer_params"], "transfer_id": tid}
        pheaders = {**headers, DATA_PARALLEL_RANK_HEADER: str(rank["dp_rank"])}
        task = asyncio.create_task(self._prefill(index, path, pbody, pheaders, keys))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.metrics.streamed.inc()
        return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
                "remote_request_id": tid, "remote_engine_id": rank["remote_engine_id"],
                "remote_host": rank["remote_host"], "remote_port": rank["remote_port"],
                "lease_s": rank.get("lease_s"), "block_size": info.get("block_size")}

    async def _info(self, url: str, headers: dict[str, str]) -> dict[str, Any] | None:
        cached = self._endpoints.get(url)
        if cached is not None and time.monotonic() - cached[0] < ENDPOINTS_TTL_S:
            return cached[1]
        auth = {k: v for k, v in headers.items() if k == "authorization"}
        info = None
        try:
            resp = await self.client.get(url + ENDPOINTS_PATH, headers=auth,
                                         timeout=ENDPOINTS_TIMEOUT_S)
            if resp.is_success:
                info = resp.json()
        except (httpx.TransportError, ValueError) as e:
            logger.info("prefill instance %s: no KV endpoints (%s); sequential flow", url, e)
        self._endpoints[url] = (time.monotonic(), info)
        return info

    async def _prefill(self, index: int, path: str, body: dict[str, Any],
                       headers: dict[str, str], keys: list[bytes]) -> None:
        url = self.pool.urls[index]
        call = BackendCall(self.pool, self.metrics, PREFILL, index)
        try:
            resp = await self.client.post(url + path, json=body, headers=headers)
        except httpx.TransportError as e:
            call.finish("error")
            self.pool.mark_failed(index)
            self._endpoints.pop(url, None)
            logger.warning("streamed prefill at %s failed: %s (the decode's pull fails and "
                           "follows its kv_load_failure_policy)", url, e)
            return
        call.finish(resp.status_code)
        self.pool.mark_ok(index)
        if resp.is_success:
            self.pool.record(index, keys)
        else:
            self._endpoints.pop(url, None)
            logger.warning("streamed prefill at %s answered %d: %s", url, resp.status_code,
                           resp.text[:300])

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
