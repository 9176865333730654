"""Time of the MoE all-to-all (dispatch, combine) and of point-to-point transfers from bytes:
a fixed latency plus the bytes over the slowest link class they cross.

Link classes: intra-node (NVLink; gloo over shared memory/loopback in the CPU profile) and
inter-node (InfiniBand/RoCE, one NIC per GPU). A rank's intra- and inter-node traffic run
concurrently, so an all-to-all takes

    latency(op) + max(intra_bytes / (nvlink_bw * eff_nvl), inter_bytes / (nic_bw * eff_rdma))

where the bytes are a rank's bottleneck direction (the larger of what it sends and receives
on that link). The latency and efficiencies are DeepEP's (``hardware.py``): its low-latency
table pins the fixed cost, its normal-mode table the efficiencies, and the functions
``deepep_low_latency`` / ``deepep_normal_bandwidth`` below rebuild both tables from the model
(``tests/sim/test_links.py`` checks them against the published figures).

Modes (widellm's backend names): ``all2all_fixed`` is DeepEP's low-latency mode (decode: one
message per (token, expert) copy, pure RDMA across nodes); ``all2all`` is the normal mode
(prefill: a token crosses to each remote *node* once and is forwarded over NVLink there, so
inter-node rows are deduplicated per node, see :func:`node_dedup_factor`);
``allgather_reducescatter`` moves every rank's tokens to every rank.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from widellm.sim.hardware import HardwareProfile

LOW_LATENCY = "low_latency"
NORMAL = "normal"
ALLGATHER = "allgather_reducescatter"
LOCAL = "local"

# FP8 dispatch row: one byte per hidden value plus one fp32 scale per 128 values (DeepEP's
# per-token, per-128-channel quantization; these bytes reproduce its reported GB/s exactly).
FP8_SCALE_BLOCK = 128
FP32_BYTES = 4
BF16_BYTES = 2
# widellm's own rows carry the local expert id and gate weight besides the hidden vector.
ROW_METADATA_BYTES = 8

# DeepEP legacy README, low-latency kernels on H800 + CX7 (128 tokens, hidden 7168, top-8,
# FP8 dispatch, BF16 combine): EP -> (dispatch us, dispatch GB/s, combine us, combine GB/s).
DEEPEP_LL_TABLE: Mapping[int, tuple[float, float, float, float]] = MappingProxyType({
    8: (77, 98, 114, 127), 16: (118, 63, 195, 74), 32: (155, 48, 273, 53),
    64: (173, 43, 314, 46), 128: (192, 39, 369, 39), 256: (194, 39, 360, 40),
})
# DeepEP legacy README, normal kernels on H800 (4096 tokens, hidden 7168, top-4 groups, top-8
# experts): EP -> (dispatch GB/s, combine GB/s) at the bottleneck link (NVLink at EP8, RDMA
# above).
DEEPEP_NORMAL_TABLE: Mapping[int, tuple[float, float]] = MappingProxyType({
    8: (153, 158), 16: (43, 43), 32: (58, 57), 64: (51, 50),
})
DEEPEP_HIDDEN = 7168
DEEPEP_TOPK = 8
DEEPEP_LL_TOKENS = 128
DEEPEP_NORMAL_TOKENS = 4096
DEEPEP_NODE_LIMIT = 4  # DeepSeek-V3 node-limited routing: a token's experts on <= 4 nodes


def backend_mode(backend: str, num_ranks: int, decode_only: bool) -> str:
    """Link-usage pattern of widellm's ``--all2all-backend`` for one step."""
    if num_ranks <= 1:
        return LOCAL
    if backend == "all2all_fixed":
        return LOW_LATENCY
    if backend == "all2all":
        return NORMAL
    if backend == ALLGATHER:
        return ALLGATHER
    if backend == "auto":
        # widellm's PerStepDispatcher: the fixed exchange when no rank has more rows than a
        # decode step, the variable one when prompt tokens are in the step.
        return LOW_LATENCY if decode_only else NORMAL
    raise ValueError(f"unknown all2all backend {backend!r}")


def dispatch_row_bytes(profile: HardwareProfile, hidden: int, act_bytes: int) -> float:
    """Bytes one token copy takes in dispatch."""
    if profile.dispatch_fp8:
        return hidden + hidden / FP8_SCALE_BLOCK * FP32_BYTES
    return hidden * act_bytes + ROW_METADATA_BYTES


def combine_row_bytes(profile: HardwareProfile, hidden: int, act_bytes: int) -> float:
    """Bytes one expert output row takes in combine (BF16 on GPUs, as DeepEP)."""
    if profile.dispatch_fp8:
        return hidden * BF16_BYTES
    return hidden * act_bytes


def all_to_all_time(profile: HardwareProfile, intra_bytes: float, inter_bytes: float,
                    op: str, num_ranks: int) -> float:
    """Seconds of one dispatch (``op="dispatch"``) or combine on one rank; 0 for one rank."""
    if num_ranks <= 1:
        return 0.0
    latency = (profile.a2a_dispatch_latency_s if op == "dispatch"
               else profile.a2a_combine_latency_s)
    t_intra = max(intra_bytes, 0.0) / (profile.nvlink_bandwidth * profile.a2a_nvlink_eff)
    t_inter = max(inter_bytes, 0.0) / (profile.internode_bandwidth * profile.a2a_rdma_eff)
    return latency + max(t_intra, t_inter)


def allgather_time(profile: HardwareProfile, bytes_per_rank: float, num_ranks: int,
                   ranks_per_node: int) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) where each rank contributes
    ``bytes_per_rank``: N-1 ring steps, each a point-to-point transfer over the slowest link
    of the ring."""
    if num_ranks <= 1:
        return 0.0
    multi_node = num_ranks > ranks_per_node
    bw = (profile.internode_bandwidth * profile.a2a_rdma_eff if multi_node
          else profile.nvlink_bandwidth * profile.a2a_nvlink_eff)
    latency = profile.internode_latency_s if multi_node else profile.nvlink_latency_s
    steps = num_ranks - 1
    return steps * (latency + bytes_per_rank / bw)


def point_to_point_time(profile: HardwareProfile, num_bytes: float, inter_node: bool) -> float:
    """Seconds of one transfer of ``num_bytes`` (e.g. a request's KV for P/D)."""
    if inter_node:
        return profile.internode_latency_s + num_bytes / (
            profile.internode_bandwidth * profile.a2a_rdma_eff)
    return profile.nvlink_latency_s + num_bytes / (
        profile.nvlink_bandwidth * profile.a2a_nvlink_eff)


def node_dedup_factor(top_k: int, num_nodes: int, node_limit: int | None = None) -> float:
    """Inter-node rows per inter-node token copy in normal mode, for uniform routing.

    A token sends one row to each remote node holding any of its ``top_k`` experts instead of
    one per expert. With experts spread uniformly over ``n`` nodes (``n`` = ``num_nodes``, or
    the routing's node limit when smaller), a token hits ``n (1 - (1 - 1/n)^k)`` distinct
    nodes; the remote ones over the ``k (n-1)/n`` remote copies give the factor
    ``n (1 - (1 - 1/n)^k) / k``."""
    if num_nodes <= 1 or top_k <= 0:
        return 1.0
    n = min(num_nodes, node_limit) if node_limit else num_nodes
    return min(1.0, n * (1.0 - (1.0 - 1.0 / n) ** top_k) / top_k)


def uniform_copies_split(copies: float, num_ranks: int,
                         ranks_per_node: int) -> tuple[float, float, float]:
    """(self, other ranks of the node, other nodes) share of ``copies`` under uniform routing."""
    per_node = min(ranks_per_node, num_ranks)
    self_part = copies / num_ranks
    intra = copies * (per_node - 1) / num_ranks
    return self_part, intra, copies - self_part - intra


def deepep_low_latency(profile: HardwareProfile, num_ranks: int,
                       tokens: int = DEEPEP_LL_TOKENS, hidden: int = DEEPEP_HIDDEN,
                       top_k: int = DEEPEP_TOPK) -> tuple[float, float]:
    """(dispatch s, combine s) the model predicts for DeepEP's low-latency benchmark."""
    copies = tokens * top_k
    _, intra, inter = uniform_copies_split(copies, num_ranks, profile.gpus_per_node)
    d_row = dispatch_row_bytes(profile, hidden, BF16_BYTES)
    c_row = combine_row_bytes(profile, hidden, BF16_BYTES)
    return (all_to_all_time(profile, intra * d_row, inter * d_row, "dispatch", num_ranks),
            all_to_all_time(profile, intra * c_row, inter * c_row, "combine", num_ranks))


def deepep_normal_bandwidth(profile: HardwareProfile, num_ranks: int,
                            tokens: int = DEEPEP_NORMAL_TOKENS, hidden: int = DEEPEP_HIDDEN,
                            top_k: int = DEEPEP_TOPK) -> tuple[float, float]:
    """(dispatch, combine) bottleneck GB/s the model predicts for DeepEP's normal benchmark:
    the bottleneck link's bytes over the modelled time, as DeepEP reports it."""
    copies = tokens * top_k
    nodes = max(1, num_ranks // profile.gpus_per_node)
    _, intra, inter = uniform_copies_split(copies, num_ranks, profile.gpus_per_node)
    inter *= node_dedup_factor(top_k, nodes, DEEPEP_NODE_LIMIT)
    out = []
    for op, row in (("dispatch", dispatch_row_bytes(profile, hidden, BF16_BYTES)),
                    ("combine", combine_row_bytes(profile, hidden, BF16_BYTES))):
        seconds = all_to_all_time(profile, intra * row, inter * row, op, num_ranks)
        bottleneck = inter * row if nodes > 1 else intra * row
        out.append(bottleneck / seconds / 1e9)
    return out[0], out[1]
