"""``TCPConnector``: KV transfer between independent deployments over plain TCP.

Extra config (``kv_connector_extra_config``): ``side_channel_host`` (the address consumers
reach this instance at, and bind to; default 127.0.0.1), ``side_channel_port`` (rank r
listens on port + r; default 0: a free port per rank), ``lease_s`` (how long a finished
prompt's blocks wait for their consumer; default 30), ``transfer_timeout_s`` (default 30),
``heartbeat_interval_s`` (default a third of the producer's lease).

The consumer pulls: one connection per request, whole blocks layer by layer, each layer's
crc32 checked before it is written into the cache. A streamed pull (a ``transfer_id``, see
``streams.py``) starts while the prompt still runs on the producer, which sends each layer
as soon as its forward wrote it. Loads run on a thread pool, so the engine
keeps stepping other requests meanwhile. The side channel that serves them is this process's
own, so a restarted producer has a new engine id and refuses pulls made for the old one.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from widellm.kv_transfer import faults, tcp_client, tcp_control
from widellm.kv_transfer.base import (
    KVConnectorMetadata, KVConnectorOutput, KVConnectorWorker, LoadSpec,
)
from widellm.kv_transfer.config import KVTransferConfig
from widellm.kv_transfer.holds import HoldTable
from widellm.kv_transfer.pull_scheduler import transfer_id
from widellm.kv_transfer.stats import KVTransferStats, TransferError
from widellm.kv_transfer.streams import StreamTable
from widellm.kv_transfer.tcp_server import SideChannelServer

logger = logging.getLogger(__name__)

# Loads in flight at once; each is one connection and one layer's staging buffer.
MAX_CONCURRENT_LOADS = 8
# Shortest gap between two heartbeat rounds (a very short lease must not flood the producer).
MIN_HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 5.0
# Requests failed by a heartbeat, remembered so that a load queued for one is skipped; far
# more than loads can be queued at once (MAX_CONCURRENT_LOADS run, the rest wait).
MAX_HEARTBEAT_FAILURES_KEPT = 1024


class TCPConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, block_size: int, dp_rank: int) -> None:
        super().__init__(config, block_size)
        # A new identity every start: pulls meant for a previous process are refused.
        self.engine_id = f"{uuid.uuid4().hex}-dp{dp_rank}"
        self.holds = HoldTable(config.lease_s)
        self.streams = StreamTable()
        self.caches: list[torch.Tensor] = []
        self.block_dims: list[int] = []
        self._lock = threading.Lock()
        self._progress = threading.Event()
        self._stats = KVTransferStats(failures={}, send_failures={})
        self._recved: set[str] = set()
        self._failed: dict[str, str] = {}
        self._load_errors: set[int] = set()
        self._tracked: dict[str, dict[str, Any]] = {}
        self._heartbeat_failed: dict[str, str] = {}
        self._stop = threading.Event()
        self._wake_heartbeats = threading.Event()  # a request to heartbeat for arrived
        self.server = None
        if config.is_producer:
            base = int(config.extra("side_channel_port", 0))
            self.server = SideChannelServer(
                str(config.extra("side_channel_host", "127.0.0.1")),
                base + dp_rank if base else 0, self.engine_id, self.holds,
                lambda: (self.caches, self.block_dims), self._sent, config.transfer_timeout_s,
                self.streams)
        self._loads = None
        self._heartbeats = None
        if config.is_consumer:
            self._loads = ThreadPoolExecutor(MAX_CONCURRENT_LOADS,
                                             thread_name_prefix="widellm-kv-load")
            self._heartbeats = threading.Thread(target=self._heartbeat_loop,
                                                name="widellm-kv-heartbeat", daemon=True)
            self._heartbeats.start()

    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_dims: list[int]) -> None:
        self.caches, self.block_dims = list(kv_caches), list(block_dims)
        self.streams.num_layers = len(self.caches)

    def transfer_params(self) -> dict[str, Any]:
        if self.server is None:
            return {}
        return {"remote_engine_id": self.engine_id, "remote_host": self.server.host,
                "remote_port": self.server.port, "lease_s": self.holds.lease_s}

    # ---- the engine loop's calls -------------------------------------------------------

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for rid in metadata.reqs_to_unstream:  # before the blocks can be written again
            self.streams.cancel(rid)
            self.holds.cancel(rid)
        for rid, spec in metadata.reqs_to_stream.items():
            self.holds.add_running(rid, spec.new_block_ids)
            if spec.prompt_sha256:  # its first step
                self.streams.register(rid, spec.transfer_id, spec.prompt_sha256,
                                      spec.num_prompt_tokens)
                if self.streams.take_early_release(spec.transfer_id):
                    self.holds.release([rid])  # ends once the prompt finished
        for rid, block_ids in metadata.reqs_to_hold.items():
            self.holds.add(rid, block_ids)
        with self._lock:
            self._tracked.update(metadata.reqs_to_track)
        if metadata.reqs_to_track:
            self._wake_heartbeats.set()  # its first beat now: a restarted producer fails it
        with self._lock:
            for rid in metadata.reqs_to_release:
                self._tracked.pop(rid, None)
        if metadata.reqs_to_release:
            self._loads.submit(self._release, metadata.reqs_to_release)
        for rid, spec in metadata.reqs_to_load.items():
            self._loads.submit(self._load, rid, spec)

    def begin_forward(self, stream_tokens: dict[str, int], num_passes: int) -> None:
        self.streams.begin_forward(stream_tokens, num_passes)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        self.streams.save_layer(int(layer_name))

    def end_forward(self) -> None:
        self.streams.end_forward()

    def get_finished(self) -> KVConnectorOutput:
        sent = self.holds.collect_ended()
        # (A preempted streamed prompt held anew keeps its new stream.)
        self.streams.forget({rid for rid in sent if not self.holds.is_live(rid)})
        with self._lock:
            out = KVConnectorOutput(sent, self._recved, self._failed)
            self._recved, self._failed = set(), {}
            self._progress.clear()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> KVTransferStats:
        held, blocks = self.holds.counts()
        with self._lock:
            return self._stats.snapshot(self.holds.leases_expired, held, blocks)

    def wait_for_progress(self, timeout_s: float) -> None:
        expiry = self.holds.next_expiry_in()
        self._progress.wait(timeout_s if expiry is None else min(timeout_s, expiry))

    def shutdown(self) -> None:
        self._stop.set()
        self._wake_heartbeats.set()
        if self.server is not None:
            self.server.close()
        if self._loads is not None:
            self._loads.shutdown(wait=False, cancel_futures=True)
        if self._heartbeats is not None:
            self._heartbeats.join()

    # ---- background threads ------------------------------------------------------------

    def _load(self, rid: str, spec: LoadSpec) -> None:
        if (cause := spec.params.get("error")) is not None:
            self._fail(rid, cause, spec.local_block_ids)
            return
        fault, arg = faults.current_fault()
        if fault == "delay_pull":
            self._stop.wait(arg)
        with self._lock:
            # Heartbeats go on until the pull starts (a queue or a delay may come first);
            # one that found the producer gone has failed the request already.
            if self._heartbeat_failed.pop(rid, None) is not None:
                return
            self._tracked.pop(rid, None)
        start = time.perf_counter()
        try:
            if transfer_id(spec.params) is not None:
                num_bytes = tcp_client.pull_stream(
                    spec.params, spec.first_block, spec.num_tokens, spec.local_block_ids,
                    self.caches, self.block_dims, self.config.transfer_timeout_s)
            else:
                num_bytes = tcp_client.pull(spec.params, spec.remote_block_ids,
                                            spec.local_block_ids, self.caches, self.block_dims,
                                            self.config.transfer_timeout_s)
        except TransferError as e:
            logger.warning("KV load of %s failed: %s", rid, e)
            self._fail(rid, e.cause, spec.local_block_ids)
            return
        except Exception as e:  # a bug must fail the request, never leave it waiting
            logger.exception("KV load of %s failed", rid)
            self._fail(rid, "connection", spec.local_block_ids, str(e))
            return
        with self._lock:
            self._stats.bytes_received += num_bytes
            self._stats.recv_seconds += time.perf_counter() - start
            self._stats.num_loads += 1
            self._recved.add(rid)
            self._progress.set()

    def _fail(self, rid: str, cause: str, block_ids: list[int], _detail: str = "") -> None:
        with self._lock:
            self._stats.failures[cause] = self._stats.failures.get(cause, 0) + 1
            self._failed[rid] = cause
            self._load_errors.update(block_ids)
            self._tracked.pop(rid, None)
            self._progress.set()

    def _sent(self, num_bytes: int, seconds: float, cause: str | None) -> None:
        with self._lock:
            if cause is None:
                self._stats.bytes_sent += num_bytes
                self._stats.send_seconds += seconds
                self._stats.num_sends += 1
            else:
                self._stats.send_failures[cause] = self._stats.send_failures.get(cause, 0) + 1
            self._progress.set()

    def _release(self, reqs: dict[str, dict[str, Any]]) -> None:
        for (host, port, engine), pairs in _by_producer(reqs).items():
            streamed = [r for local, r in pairs if transfer_id(reqs[local]) is not None]
            try:
                for ids, is_streamed in (([r for _, r in pairs if r not in streamed], False),
                                         (streamed, True)):
                    if ids:
                        tcp_control.release(host, port, engine, ids, HEARTBEAT_TIMEOUT_S,
                                            is_streamed)
            except TransferError as e:  # the lease frees them in the end
                logger.info("KV release at %s:%s failed: %s", host, port, e)

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                tracked = dict(self._tracked)
            leases = [float(p.get("lease_s", self.config.lease_s)) for p in tracked.values()]
            interval = float(self.config.extra(
                "heartbeat_interval_s", min(leases, default=self.config.lease_s) / 3))
            for (host, port, engine), pairs in _by_producer(tracked).items():
                remote_to_local = {remote: local for local, remote in pairs}
                cause = "unknown_request"
                try:
                    unknown = tcp_control.heartbeat(host, port, engine, list(remote_to_local),
                                                    HEARTBEAT_TIMEOUT_S)
                except TransferError as e:
                    if e.cause != "engine_mismatch":  # maybe transient; a dead producer
                        logger.info("KV heartbeat to %s:%s failed: %s", host, port, e)
                        continue  # fails the pull itself
                    unknown, cause = list(remote_to_local), e.cause  # restarted: give up
                for remote in unknown:
                    local = remote_to_local.get(remote)
                    if local is not None and transfer_id(tracked[local]) is not None:
                        continue  # streamed: not scheduled there yet; the pull waits for it
                    with self._lock:
                        still = local is not None and local in self._tracked
                    if still:
                        self._fail(local, cause, [])
                        with self._lock:
                            self._heartbeat_failed[local] = cause
                            # Only a load queued before the failure pops its entry; the
                            # rest (most) are never looked at again: keep the newest.
                            while len(self._heartbeat_failed) > MAX_HEARTBEAT_FAILURES_KEPT:
                                del self._heartbeat_failed[next(iter(self._heartbeat_failed))]
            self._wake_heartbeats.wait(max(interval, MIN_HEARTBEAT_INTERVAL_S))
            self._wake_heartbeats.clear()


def _by_producer(reqs: dict[str, dict[str, Any]]
                 ) -> dict[tuple[str, int, str], list[tuple[str, str]]]:
    """(local id, the producer's request id) pairs grouped by the producer (host, port,
    engine id) their params name."""
    groups: dict[tuple[str, int, str], list[tuple[str, str]]] = defaultdict(list)
    for rid, p in reqs.items():
        groups[(str(p["remote_host"]), int(p["remote_port"]), str(p["remote_engine_id"]))
               ].append((rid, str(p["remote_request_id"])))
    return groups
