"""Where a step's routed tokens go: from each rank's token count, through the routing model
(logical experts) and the EPLB placement (physical slots), to per-rank expert work and
all-to-all traffic.

Replicas of an expert share its tokens evenly, as the engine's router sends the n-th
selection of an expert to replica ``n mod replicas`` (``eplb/routing.py``). Slots are split
contiguously over the ranks (``ExpertParallelContext.expert_map``): rank ``r`` holds slots
``[r*S, (r+1)*S)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ExpertStep:
    """One step's expert work, per rank (arrays of ``[R]``) and per physical slot.

    Attributes:
        recv_tokens: routed token copies each rank's experts compute (per MoE layer).
        max_expert_tokens: the most tokens one of its slots receives.
        active_slots: its slots that receive at least one token.
        sent_intra_node, sent_inter_node: copies it sends to other ranks of its node / of
            other nodes (its own copies stay local).
        slot_tokens: ``[P]`` tokens per physical slot summed over the sources (EPLB's load).
    """

    recv_tokens: np.ndarray
    max_expert_tokens: np.ndarray
    active_slots: np.ndarray
    sent_intra_node: np.ndarray
    sent_inter_node: np.ndarray
    slot_tokens: np.ndarray

    @property
    def balancedness(self) -> float:
        """Mean over max of the ranks' routed tokens (1.0 when balanced or empty)."""
        top = float(self.recv_tokens.max()) if self.recv_tokens.size else 0.0
        return float(self.recv_tokens.mean()) / top if top > 0 else 1.0


class ExpertTraffic:
    """Turns logical routing counts into per-rank expert work for one pool.

    Args:
        num_ranks: ranks of the pool (EP size).
        ranks_per_node: ranks per node (all-to-all inside a node vs across nodes).
    """

    def __init__(self, num_ranks: int, ranks_per_node: int) -> None:
        self.num_ranks = num_ranks
        node = np.arange(num_ranks) // ranks_per_node
        # [R_src, R_dst]: 1 where both ranks share a node and differ.
        self._intra = (node[:, None] == node[None, :]) & ~np.eye(num_ranks, dtype=bool)
        self._inter = node[:, None] != node[None, :]

    def step(self, logical_counts: np.ndarray, phys_to_logical: np.ndarray,
             replica_count: np.ndarray) -> ExpertStep:
        """``logical_counts [R, E]``: routed copies each source rank sends to each logical
        expert; ``phys_to_logical [P]`` and ``replica_count [E]``: the placement."""
        r = self.num_ranks
        per_slot = logical_counts[:, phys_to_logical] / replica_count[phys_to_logical]
        per_pair = per_slot.reshape(r, r, -1)  # [src, dst, local slot]
        matrix = per_pair.sum(axis=2)  # [src, dst]
        slot_load = per_pair.sum(axis=0)  # [dst, local slot]
        return ExpertStep(
            recv_tokens=matrix.sum(axis=0),
            max_expert_tokens=slot_load.max(axis=1),
            active_slots=(slot_load > 0).sum(axis=1),
            sent_intra_node=(matrix * self._intra).sum(axis=1),
            sent_inter_node=(matrix * self._inter).sum(axis=1),
            slot_tokens=slot_load.reshape(-1),
        )
