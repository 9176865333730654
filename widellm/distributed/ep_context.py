"""What an MoE layer needs to shard its routed experts over the expert-parallel group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def default_fixed_capacity(max_seqs_per_rank: int, top_k: int, experts_per_rank: int) -> int:
    """Rows per rank pair of the fixed-capacity buffers unless ``--all2all-fixed-capacity``
    sets them: a rank sends a destination at most one row per (token, expert held there), so
    ``max_seqs_per_rank * min(top_k, experts_per_rank)`` fits any decode step and decode never
    spills; a prefill may, and then takes the checked spill round. (Sizing for
    max_num_batched_tokens instead would make the largest blocks that size.)

    E.g. 256 sequences, top-6 routing, 32 experts per rank: 1,536 rows.
    """
    return max_seqs_per_rank * min(top_k, experts_per_rank)


@dataclass(frozen=True, eq=False)
class ExpertParallelContext:
    """This rank's place in the EP group and how its MoE layers move tokens.

    Attributes:
        rank, size: this rank and the EP group size.
        group: the device process group the dispatchers' collectives run on.
        all2all_backend: registered dispatcher name (``--all2all-backend``); ``auto`` picks
            the fixed-capacity exchange for decode steps and the variable one otherwise.
        fixed_capacity: rows per rank pair for ``all2all_fixed``/``auto`` (None: enough for any
            decode step, see :meth:`dispatcher_kwargs`).
        max_tokens_per_rank: most tokens one rank puts in a forward
            (``max_num_batched_tokens``), which bounds the worst case.
        max_seqs_per_rank: most sequences in one step (``max_num_seqs``): a decode step has
            at most that many tokens.
        num_redundant_experts: physical expert slots beyond the logical experts (EPLB
            replicas); physical slots are split contiguously over the ranks.
        enable_eplb: route through replicas and record expert load (EPLB).
        fixed_size_per_step: the fixed-capacity exchange moves blocks sized for each step's
            agreed rows, not the whole capacity (False where decode graphs record it: a
            graph's exchange must have one shape whatever the other ranks run).
    """

    rank: int
    size: int
    group: dist.ProcessGroup | None
    all2all_backend: str
    fixed_capacity: int | None
    max_tokens_per_rank: int
    max_seqs_per_rank: int = 1
    num_redundant_experts: int = 0
    enable_eplb: bool = False
    fixed_size_per_step: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"EP rank {self.rank} out of range for size {self.size}")

    def num_physical(self, num_experts: int) -> int:
        """Physical expert slots of a layer with ``num_experts`` logical experts."""
        return num_experts + self.num_redundant_experts

    def expert_map(self, num_experts: int) -> torch.Tensor:
        """``[P]`` int64: each physical slot's local index here, -1 elsewhere
        (``P = num_experts + num_redundant_experts``).

        A contiguous split: rank r holds slots ``[r*S, (r+1)*S)``, S = P / size.
        E.g. 8 slots on 2 ranks, rank 1: ``[-1, -1, -1, -1, 0, 1, 2, 3]``.
        """
        num_physical = self.num_physical(num_experts)
        if num_physical % self.size:
            raise ValueError(
                f"{num_experts} routed experts + {self.num_redundant_experts} redundant slots "
                f"do not split evenly over {self.size} EP ranks"
            )
        per_rank = num_physical // self.size
        expert_map = torch.full((num_physical,), -1, dtype=torch.int64)
        start = self.rank * per_rank
        expert_map[start:start + per_rank] = torch.arange(per_rank)
        return expert_map

    def dispatcher_kwargs(self, top_k: int, num_experts: int) -> dict:
        """Keyword arguments of the chosen dispatcher beyond the expert map."""
        kwargs: dict = {"group": self.group}
        if self.all2all_backend in ("all2all_fixed", "auto"):
            kwargs["capacity"] = self.fixed_capacity or default_fixed_capacity(
                self.max_seqs_per_rank, top_k, self.num_physical(num_experts) // self.size)
            kwargs["max_tokens_per_rank"] = self.max_tokens_per_rank
            kwargs["size_per_step"] = self.fixed_size_per_step
        if self.all2all_backend == "auto":  # decode steps fixed, the others variable
            kwargs["decode_rows"] = self.max_seqs_per_rank
        return kwargs
