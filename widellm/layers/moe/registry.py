"""The registry of dispatch/combine backends, by the names ``--all2all-backend`` takes."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from widellm.layers.moe.dispatch import LocalDispatcher, MoEDispatcher
from widellm.layers.moe.dispatch_all2all import All2AllDispatcher
from widellm.layers.moe.dispatch_all2all_fixed import FixedCapacityAll2AllDispatcher
from widellm.layers.moe.dispatch_allgather import AllGatherDispatcher
from widellm.layers.moe.dispatch_per_step import PerStepDispatcher

# The expert-parallel backends take ``group=`` (all2all_fixed and auto ``capacity=``); their shared
# contract is in widellm.layers.moe.dispatch_ep.
DISPATCHER_REGISTRY: Mapping[str, type[MoEDispatcher]] = MappingProxyType({
    "local": LocalDispatcher,
    "allgather_reducescatter": AllGatherDispatcher,
    "all2all": All2AllDispatcher,
    "all2all_fixed": FixedCapacityAll2AllDispatcher,
    "auto": PerStepDispatcher,
})


def make_dispatcher(name: str, expert_map: torch.Tensor, **backend_kwargs: Any) -> MoEDispatcher:
    """Build the dispatcher backend registered as ``name``.

    ``backend_kwargs`` carry what a backend needs beyond the expert map (e.g. a process group).
    """
    try:
        cls = DISPATCHER_REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown MoE dispatcher {name!r}; known: {sorted(DISPATCHER_REGISTRY)}") from None
    return cls(expert_map, **backend_kwargs)
