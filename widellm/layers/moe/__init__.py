"""Mixture-of-Experts layer: router -> dispatch -> experts -> combine."""

from widellm.layers.moe.dispatch import (
    SKIP_EXPERT_ID,
    CombineHandle,
    DispatchedTokens,
    DispatchHandle,
    LocalDispatcher,
    MoEDispatcher,
    local_expert_ids,
)
from widellm.layers.moe.dispatch_all2all import All2AllDispatcher
from widellm.layers.moe.dispatch_all2all_fixed import FixedCapacityAll2AllDispatcher
from widellm.layers.moe.dispatch_allgather import AllGatherDispatcher
from widellm.layers.moe.dispatch_ep import ExpertParallelDispatcher
from widellm.layers.moe.experts import grouped_experts_forward, reference_experts_forward
from widellm.layers.moe.layer import ExpertParamMapping, FusedMoE, RoutingConfig
from widellm.layers.moe.registry import DISPATCHER_REGISTRY, make_dispatcher
from widellm.layers.moe.router import select_experts

__all__ = [
    "DISPATCHER_REGISTRY",
    "SKIP_EXPERT_ID",
    "All2AllDispatcher",
    "AllGatherDispatcher",
    "CombineHandle",
    "DispatchHandle",
    "DispatchedTokens",
    "ExpertParallelDispatcher",
    "ExpertParamMapping",
    "FixedCapacityAll2AllDispatcher",
    "FusedMoE",
    "LocalDispatcher",
    "MoEDispatcher",
    "RoutingConfig",
    "grouped_experts_forward",
    "local_expert_ids",
    "make_dispatcher",
    "reference_experts_forward",
    "select_experts",
]
