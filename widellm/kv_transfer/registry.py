"""The registry of KV connectors, by the names ``--kv-transfer-config``'s ``kv_connector``
takes: each a scheduler half and a worker half."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from widellm.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from widellm.kv_transfer.config import KVTransferConfig
from widellm.kv_transfer.file_connector import FileConnectorWorker
from widellm.kv_transfer.pull_scheduler import PullConnectorScheduler
from widellm.kv_transfer.tcp import TCPConnectorWorker


class ConnectorHalves(NamedTuple):
    scheduler: type[PullConnectorScheduler]
    worker: type[KVConnectorWorker]
    streams: bool  # serves pulls of a prompt that still runs (a ``transfer_id``)


KV_CONNECTORS: Mapping[str, ConnectorHalves] = MappingProxyType({
    "TCPConnector": ConnectorHalves(PullConnectorScheduler, TCPConnectorWorker, True),
    "FileConnector": ConnectorHalves(PullConnectorScheduler, FileConnectorWorker, False),
})


def _halves(config: KVTransferConfig) -> ConnectorHalves:
    try:
        return KV_CONNECTORS[config.kv_connector]
    except KeyError:
        raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: "
                         f"{sorted(KV_CONNECTORS)}") from None


def check_connector_name(config: KVTransferConfig) -> None:
    _halves(config)


def supports_streaming(config: KVTransferConfig) -> bool:
    return _halves(config).streams


def make_worker(config: KVTransferConfig, block_size: int, dp_rank: int) -> KVConnectorWorker:
    return _halves(config).worker(config, block_size, dp_rank)


def make_scheduler(config: KVTransferConfig, block_size: int,
                   worker: KVConnectorWorker) -> KVConnectorScheduler:
    """The scheduler half, which names ``worker``'s endpoint in the params it hands out."""
    return _halves(config).scheduler(config, block_size, worker.transfer_params)
