"""``--all2all-backend auto``: each forward picks its all-to-all from the step's shape.

A decode step moves few rows per rank, and the fixed-capacity exchange
(``dispatch_all2all_fixed``) sends them in buffers of a size known in advance: no count
exchange first, one collective per direction, and shapes a CUDA graph can capture. A step
carrying prompt tokens moves far more rows than a decode buffer holds, and the variable
exchange (``dispatch_all2all``) sends exactly what each rank pair needs. The choice is made
from the row counts every rank agreed in the step's vote, never from this rank's own batch,
so all ranks run the same collectives: the fixed one when no rank has more rows than a decode
step can (``max_num_seqs``), the variable one otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from widellm.layers.moe.dispatch import (
    CombineHandle, DispatchedTokens, DispatchHandle, MoEDispatcher,
)
from widellm.layers.moe.dispatch_all2all import All2AllDispatcher
from widellm.layers.moe.dispatch_all2all_fixed import FixedCapacityAll2AllDispatcher


@dataclass
class _ChosenDispatch(DispatchHandle):
    backend: MoEDispatcher
    inner: DispatchHandle


@dataclass
class _ChosenCombine(CombineHandle):
    backend: MoEDispatcher
    inner: CombineHandle


class PerStepDispatcher(MoEDispatcher):
    """Args:
        expert_map: ``[E_phys]`` int64, contiguous by rank (see :mod:`.dispatch_ep`).
        group: the expert-parallel process group.
        capacity: rows per rank pair of the fixed-capacity buffers.
        max_tokens_per_rank: the most tokens a rank passes to ``dispatch_launch``.
        decode_rows: the most rows a decode step has on one rank (``max_num_seqs``).
        size_per_step: the fixed-capacity exchange's blocks follow the step's agreed counts
            (False where decode graphs record it).
    """

    def __init__(self, expert_map: torch.Tensor, *, group: dist.ProcessGroup, capacity: int,
                 max_tokens_per_rank: int, decode_rows: int, size_per_step: bool = True) -> None:
        super().__init__(expert_map)
        self.variable = All2AllDispatcher(expert_map, group=group)
        self.fixed = FixedCapacityAll2AllDispatcher(
            expert_map, group=group, capacity=capacity, max_tokens_per_rank=max_tokens_per_rank,
            size_per_step=size_per_step)
        self.decode_rows = decode_rows

    def choose(self, counts: Sequence[int]) -> MoEDispatcher:
        """The backend for a call whose ranks hold ``counts`` rows."""
        return self.fixed if max(counts) <= self.decode_rows else self.variable

    def capturable(self, counts: Sequence[int], top_k: int) -> bool:
        """Where the ranks' counts choose the fixed-capacity exchange, and it is static."""
        return self.choose(counts) is self.fixed and self.fixed.capturable(counts, top_k)

    def dispatch_launch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        num_tokens_across_ranks: Sequence[int] | None = None,
    ) -> DispatchHandle:
        counts = self.variable.token_counts(topk_ids.shape[0], num_tokens_across_ranks)
        backend = self.choose(counts)
        return _ChosenDispatch(backend, backend.dispatch_launch(hidden_states, topk_ids,
                                                                topk_weights, counts))

    def dispatch_send(self, handle: DispatchHandle) -> bool:
        return handle.backend.dispatch_send(handle.inner)

    def dispatch_wait(self, handle: DispatchHandle) -> DispatchedTokens:
        return handle.backend.dispatch_wait(handle.inner)

    def combine_launch(self, expert_output: torch.Tensor, handle: DispatchHandle) -> CombineHandle:
        return _ChosenCombine(handle.backend,
                              handle.backend.combine_launch(expert_output, handle.inner))

    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        return handle.backend.combine_wait(handle.inner)
