"""The simulator's shared vocabulary: what one rank computes in one step (``RankStepLoad``,
built by the simulated runner from the real scheduler's output), where it runs
(``DeploymentShape``, ``HardwareProfile``), what the model is (``ModelShape``), and what the
step cost (``RankStepCost``, from a :class:`CostModel`).

Everything is per rank and per step; a step of a lockstep pool ends for every rank when the
slowest rank's collective ends (the cost model applies that rule, see ``cost_model.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass(frozen=True, slots=True)
class RankStepLoad:
    """One rank's forward in one step, as counts (no tensors).

    Attributes:
        num_tokens: rows of the forward (prompt-chunk tokens + decode tokens, padding included;
            a dummy batch's rows when the rank has no request).
        num_prefill_tokens: rows that are prompt tokens.
        num_decode_tokens: rows that are decode tokens (one per running sequence).
        num_seqs: sequences in the step.
        attn_kv_read_tokens: KV-cache tokens read by attention: each decode row its sequence's
            context, each prompt chunk its context before the chunk (once per chunk).
        attn_score_pairs: (query row, key) pairs attention scores: sum over rows of the
            context each row attends to (prefill causal chunks included).
        expert_recv_tokens: routed token copies this rank's experts compute, per MoE layer
            (after dispatch and EPLB placement; a mean over the MoE layers).
        max_expert_tokens: the most tokens one local expert receives (per MoE layer mean).
        active_local_experts: local experts that receive at least one token (their weights
            are read).
        sent_intra_node: routed token copies this rank sends to other ranks of its node, per
            MoE layer.
        sent_inter_node: routed token copies this rank sends to ranks of other nodes, per MoE
            layer.
        is_dummy: the rank had no request and ran a dummy batch to keep the collectives paired.
    """

    num_tokens: int
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    attn_kv_read_tokens: int = 0
    attn_score_pairs: int = 0
    expert_recv_tokens: float = 0.0
    max_expert_tokens: float = 0.0
    active_local_experts: int = 0
    sent_intra_node: float = 0.0
    sent_inter_node: float = 0.0
    is_dummy: bool = False


@dataclass(frozen=True, slots=True)
class RankStepCost:
    """One rank's simulated step.

    Attributes:
        total_s: wall time of the step on this rank (equal on every rank of a lockstep pool
            once the collective waits are included).
        breakdown: seconds per phase, e.g. ``{"attention": .., "dense_gemm": .., "expert_gemm":
            .., "dispatch": .., "combine": .., "launch": .., "wait": ..}``; ``exposed_comm`` and
            ``hidden_comm`` split the all-to-all time into what the step waited for and what DBO
            overlapped with compute.
    """

    total_s: float
    breakdown: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DeploymentShape:
    """One pool (prefill, decode or colocated) of a deployment.

    Attributes:
        num_ranks: DP ranks (= EP size when expert parallel).
        ranks_per_node: GPUs (or CPU ranks) per node; all-to-all between nodes uses the
            inter-node link.
        expert_parallel: routed experts sharded over the ranks (else replicated per rank).
        all2all_backend: "all2all", "all2all_fixed", "allgather_reducescatter" or "auto"
            (widellm's names; the cost model maps them to a link-usage pattern).
        cuda_graphs: decode steps replay CUDA graphs (launch overhead of graphs, not eager).
        num_redundant_experts: EPLB's extra physical experts.
        max_num_seqs: the most sequences of a rank's step, which the fixed-capacity buffers
            are sized for (``all2all_fixed``; ``auto``'s decode steps).
    """

    num_ranks: int
    ranks_per_node: int = 8
    expert_parallel: bool = True
    all2all_backend: str = "all2all"
    cuda_graphs: bool = True
    num_redundant_experts: int = 0
    max_num_seqs: int = 256


class CostModel(Protocol):
    """Prices one lockstep step of a pool (see ``cost_model.py`` for the model and its
    sources)."""

    def step(self, loads: Sequence[RankStepLoad], split: bool) -> list[RankStepCost]:
        """``loads[r]`` is rank r's forward; ``split`` whether the ranks run it as two
        overlapped micro-batches (DBO). Returns one cost per rank, in order."""
        ...


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One simulated request's life, in virtual seconds (None: never reached)."""

    request_id: str
    pool_rank: int
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    first_token_s: float | None
    finish_s: float | None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One lockstep step of one pool.

    Attributes:
        pool: "colocated", "prefill" or "decode".
        start_s: virtual time the step started.
        duration_s: its length (the slowest rank's, collectives included).
        split: whether the ranks ran it as two DBO micro-batches.
        num_tokens: forward rows per rank.
        costs: per-rank cost and breakdown.
        balancedness: mean / max of the ranks' routed expert tokens in this step (1.0 =
            perfectly balanced; DeepSeek's EPLB metric).
    """

    pool: str
    start_s: float
    duration_s: float
    split: bool
    num_tokens: tuple[int, ...]
    costs: tuple[RankStepCost, ...]
    balancedness: float


@dataclass
class SimResult:
    """What a simulation produced; ``report.py`` turns it into tables, JSON and plots."""

    requests: list[RequestRecord]
    steps: list[StepRecord]
    num_gpus: int
    config: dict
    sim_wall_s: float = 0.0
    # (virtual time, output tokens that reached the frontend then), in time order: one entry
    # per output batch of the last pool.
    output_events: list[tuple[float, int]] = field(default_factory=list)
