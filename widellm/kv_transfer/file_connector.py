"""``FileConnector``: KV through a shared folder, for debugging a deployment (and for
inspecting what moves): the producer writes each finished prompt's blocks to
``<path>/<engine id>-<request id>.kv`` (same checksummed frames as the TCP connector) and
frees them at once; the consumer waits for the file, loads and deletes it.

Extra config: ``path`` (the folder, required; both sides must see it),
``transfer_timeout_s`` (how long a consumer waits for the file; default 30).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from widellm.kv_transfer.base import (
    KVConnectorMetadata, KVConnectorOutput, KVConnectorWorker, LoadSpec,
)
from widellm.kv_transfer.config import KVTransferConfig
from widellm.kv_transfer.kv_layout import describe, gather_blocks, layer_nbytes, scatter_blocks
from widellm.kv_transfer.stats import KVTransferStats, TransferError
from widellm.kv_transfer.wire import Receiver, crc32, send_frame, send_message

logger = logging.getLogger(__name__)
# How often a consumer looks for a file that is not written yet.
FILE_POLL_S = 0.01


class _FileStream:
    """A file with the socket calls wire.py makes."""

    def __init__(self, f) -> None:
        self.f = f

    def sendall(self, data) -> None:
        self.f.write(data)

    def recv_into(self, view: memoryview) -> int:
        return self.f.readinto(view)

    def settimeout(self, _timeout: float) -> None:
        pass


def kv_file(params: dict[str, Any]) -> str:
    return os.path.join(params["kv_dir"], f"{params['remote_engine_id']}-"
                        f"{params['remote_request_id']}.kv".replace(os.sep, "_"))


class FileConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, block_size: int, dp_rank: int) -> None:
        super().__init__(config, block_size)
        if "path" not in config.kv_connector_extra_config:
            raise ValueError('FileConnector needs kv_connector_extra_config {"path": DIR}')
        self.dir = str(config.kv_connector_extra_config["path"])
        os.makedirs(self.dir, exist_ok=True)
        self.engine_id = f"{uuid.uuid4().hex}-dp{dp_rank}"
        self.caches: list[torch.Tensor] = []
        self.block_dims: list[int] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="widellm-kv-file")
        self._stats = KVTransferStats(failures={}, send_failures={})
        self._out = KVConnectorOutput()
        self._held: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_dims: list[int]) -> None:
        self.caches, self.block_dims = list(kv_caches), list(block_dims)

    def transfer_params(self) -> dict[str, Any]:
        return {"remote_engine_id": self.engine_id, "kv_dir": self.dir}

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for rid, block_ids in metadata.reqs_to_hold.items():
            with self._lock:
                self._held[rid] = len(block_ids)
            self._pool.submit(self._write, rid, block_ids)
        for rid, spec in metadata.reqs_to_load.items():
            self._pool.submit(self._read, rid, spec)

    def _write(self, rid: str, block_ids: list[int]) -> None:
        params = {"kv_dir": self.dir, "remote_engine_id": self.engine_id,
                  "remote_request_id": rid}
        path, start, cause = kv_file(params), time.perf_counter(), None
        ids = torch.tensor(block_ids, dtype=torch.int64)
        num_bytes = 0
        try:
            with open(path + ".tmp", "wb") as f:  # renamed when complete: never half-read
                stream = _FileStream(f)
                send_message(stream, {"ok": True, "layout": describe(self.caches,
                                                                     self.block_dims)})
                for cache, dim in zip(self.caches, self.block_dims):
                    view = memoryview(gather_blocks(cache, dim, ids).numpy())
                    send_frame(stream, view, crc32(view))
                    num_bytes += len(view)
            os.replace(path + ".tmp", path)
        except OSError as e:
            cause = "connection"
            logger.warning("KV file %s not written: %s", path, e)
        with self._lock:
            if cause is None:
                self._stats.bytes_sent += num_bytes
                self._stats.send_seconds += time.perf_counter() - start
                self._stats.num_sends += 1
            else:
                self._stats.send_failures[cause] = self._stats.send_failures.get(cause, 0) + 1
            self._held.pop(rid, None)
            self._out.finished_sending.add(rid)  # on disk (or lost): the blocks may go

    def _read(self, rid: str, spec: LoadSpec) -> None:
        start = time.perf_counter()
        try:
            if (cause := spec.params.get("error")) is not None:
                raise TransferError(cause, "the parameters do not fit this request")
            num_bytes = self._load(kv_file(spec.params), spec)
        except (TransferError, OSError, KeyError) as e:
            cause = e.cause if isinstance(e, TransferError) else "connection"
            logger.warning("KV file load of %s failed: %s", rid, e)
            with self._lock:
                self._stats.failures[cause] = self._stats.failures.get(cause, 0) + 1
                self._out.failed_recving[rid] = cause
            return
        with self._lock:
            self._stats.bytes_received += num_bytes
            self._stats.recv_seconds += time.perf_counter() - start
            self._stats.num_loads += 1
            self._out.finished_recving.add(rid)

    def _load(self, path: str, spec: LoadSpec) -> int:
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TransferError("timeout", f"{path} did not appear")
            time.sleep(FILE_POLL_S)
        local = torch.tensor(spec.local_block_ids, dtype=torch.int64)
        with open(path, "rb") as f:
            receiver = Receiver(_FileStream(f), deadline)
            if receiver.message().get("layout") != describe(self.caches, self.block_dims):
                raise TransferError("layout", "the producer's KV cache layout differs")
            # The file holds every block of the prompt; the consumer wants a tail of them.
            num_all = len(spec.params["remote_block_ids"])
            total = 0
            for cache, dim in zip(self.caches, self.block_dims):
                every = torch.empty(layer_nbytes(cache, dim, num_all), dtype=torch.uint8)
                receiver.frame_into(memoryview(every.numpy()))
                part = _take_blocks(cache, dim, every, num_all, spec.first_block,
                                    len(spec.local_block_ids))
                scatter_blocks(cache, dim, local, part)
                total += part.numel()
        os.remove(path)
        return total

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            out, self._out = self._out, KVConnectorOutput()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def stats(self) -> KVTransferStats:
        with self._lock:
            return self._stats.snapshot(0, len(self._held), sum(self._held.values()))

    def wait_for_progress(self, timeout_s: float) -> None:
        time.sleep(timeout_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _take_blocks(cache: torch.Tensor, dim: int, every: torch.Tensor, num_all: int,
                 first: int, count: int) -> torch.Tensor:
    """Blocks ``first .. first + count`` of one layer's wire bytes of ``num_all`` blocks."""
    shape = list(cache.shape)
    shape[dim] = num_all
    blocks = every.view(cache.dtype).view(shape).narrow(dim, first, count)
    return blocks.contiguous().view(-1).view(torch.uint8)
