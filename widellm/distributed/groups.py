"""Process groups of a data-parallel deployment, through torch.distributed.

The frontend hosts a ``TCPStore`` (see ``engine/core_client.py``); every rank joins it as a
client and calls ``init_process_group`` with it, so the rendezvous works the same on one
machine and across many. Two groups exist on every rank:

- ``device_group``: the MoE tokens' all-to-alls (NCCL on GPU, gloo on CPU);
- ``cpu_group``: gloo, for the small host-side all-reduces that keep ranks in lockstep. It is
  its own group so that control traffic never interleaves with a layer's collectives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class DPGroups:
    rank: int
    size: int
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup


def collective_backend(device: str) -> str:
    """NCCL where the engine's tensors are on CUDA, gloo for the CPU engine (also on GPU hosts)."""
    return "nccl" if device == "cuda" else "gloo"


def init_dp_groups(
    rank: int, size: int, store_host: str, store_port: int, timeout_s: float,
    device: str = "cpu",
) -> DPGroups:
    """Join the deployment's rendezvous as ``rank`` of ``size``; blocks until all have joined."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timeout)
    backend = collective_backend(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    logger.info("DP rank %d/%d joined (%s at %s:%d)", rank, size, backend, store_host, store_port)
    return DPGroups(rank, size, dist.group.WORLD, cpu_group)


def destroy_dp_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
