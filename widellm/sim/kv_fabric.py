"""Disaggregated prefill/decode in the simulator: the KV connector's worker half, simulated.

The scheduler half is the engine's own (``PullConnectorScheduler``, the TCP and file
connectors' shared half): it decides which prompt tokens a decode rank loads, parks the
request in ``WAITING_FOR_REMOTE_KVS`` and has the prefill rank hold the finished prompt's
blocks. Only the transport is simulated: a load issued at virtual time ``t`` ends at
``t + transfer_s(tokens)``; then the decode rank's scheduler sees it in ``finished_recving``
(the request rejoins its waiting queue with those tokens computed) and the prefill rank's in
``finished_sending`` (its held blocks are freed).

Links: each rank has one network link (its NIC), which a transfer holds at both ends for
its whole duration, first come first served. A load waits until the producer's and the
consumer's links are both free, so one prefill rank handing prompts to several decode ranks,
or several prefill ranks sending to one decode rank, move them one after another at the
link's rate instead of all at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from widellm.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorWorker
from widellm.kv_transfer.config import KVTransferConfig
from widellm.kv_transfer.stats import KVTransferStats
from widellm.sim.clock import VirtualClock

# The connector name whose scheduler half the simulated worker pairs with (the pull half).
SIM_CONNECTOR_NAME = "TCPConnector"


class SimKVFabric:
    """Every simulated worker of the deployment, and the transfers in flight between them.

    Args:
        clock: the deployment's virtual clock.
        transfer_s: seconds to move a prompt's KV of ``num_tokens`` tokens.
    """

    def __init__(self, clock: VirtualClock, transfer_s: Callable[[int], float]) -> None:
        self.clock = clock
        self.transfer_s = transfer_s
        self.workers: dict[str, "SimKVWorker"] = {}
        # (end_s, sequence, consumer engine id, request id, producer engine id, remote id)
        self._in_flight: list[tuple[float, int, str, str, str | None, str | None]] = []
        self._seq = 0
        # Engine id -> when its link is next free (virtual seconds).
        self._link_free_s: dict[str, float] = {}

    def worker(self, config: KVTransferConfig, block_size: int, engine_id: str) -> "SimKVWorker":
        w = SimKVWorker(config, block_size, engine_id, self)
        self.workers[engine_id] = w
        return w

    def start_load(self, consumer: str, req_id: str, params: dict[str, Any],
                   num_tokens: int) -> float:
        """Queue a load on both ends' links; returns when it ends."""
        producer = params.get("remote_engine_id")
        ends = [consumer] + ([producer] if producer is not None else [])
        start = max([self.clock.now] + [self._link_free_s.get(e, 0.0) for e in ends])
        end = start + self.transfer_s(num_tokens)
        for e in ends:
            self._link_free_s[e] = end
        self._seq += 1
        heapq.heappush(self._in_flight, (end, self._seq, consumer, req_id, producer,
                                         params.get("remote_request_id")))
        return end

    def release(self, params: dict[str, Any]) -> None:
        """A consumer will not pull these blocks (its prefix cache had the prompt)."""
        producer = self.workers.get(params.get("remote_engine_id"))
        if producer is not None and params.get("remote_request_id"):
            producer.finished.finished_sending.add(params["remote_request_id"])

    def next_event_s(self) -> float | None:
        """When the next transfer ends (None: none in flight)."""
        return self._in_flight[0][0] if self._in_flight else None

    def deliver(self) -> None:
        """Hand every transfer that has ended by now to both of its ends."""
        now = self.clock.now
        while self._in_flight and self._in_flight[0][0] <= now:
            _, _, consumer, req_id, producer, remote_id = heapq.heappop(self._in_flight)
            self.workers[consumer].finished.finished_recving.add(req_id)
            if producer in self.workers and remote_id:
                self.workers[producer].finished.finished_sending.add(remote_id)


class SimKVWorker(KVConnectorWorker):
    """One rank's connector worker half on the fabric (see the module docstring)."""

    def __init__(self, config: KVTransferConfig, block_size: int, engine_id: str,
                 fabric: SimKVFabric) -> None:
        super().__init__(config, block_size)
        self.engine_id, self.fabric = engine_id, fabric
        self.finished = KVConnectorOutput()
        self._stats = KVTransferStats()

    def register_kv_caches(self, kv_caches: list, block_dims: list[int]) -> None:
        """No tensors in the simulator."""

    def transfer_params(self) -> dict[str, Any]:
        return {"remote_engine_id": self.engine_id, "remote_host": "sim", "remote_port": 0}

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for req_id, spec in metadata.reqs_to_load.items():
            if "error" in spec.params:
                self.finished.failed_recving[req_id] = spec.params["error"]
                continue
            # The prompt's tokens past the local prefix hit (the last one is computed here).
            num_tokens = max(0, spec.num_tokens - spec.first_block * self.block_size)
            self.fabric.start_load(self.engine_id, req_id, spec.params, num_tokens)
            self._stats.num_loads += 1
        for params in metadata.reqs_to_release.values():
            self.fabric.release(params)

    def get_finished(self) -> KVConnectorOutput:
        self.fabric.deliver()
        out, self.finished = self.finished, KVConnectorOutput()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def stats(self) -> KVTransferStats:
        return self._stats
