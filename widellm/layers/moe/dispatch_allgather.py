"""``allgather_reducescatter``: the simple baseline; every rank sees every rank's tokens.

Dispatch all-gathers all ranks' tokens (hidden vector, the k physical expert ids and the k
gate weights, packed in one row per token) and each rank picks the (token, slot) pairs of its
own experts. Combine weights those rows, sums them per token into an fp32 partial over all
ranks' tokens, and a reduce-scatter hands each rank the sum for its own tokens.

Token counts differ per rank but an all-gather moves equal sizes, so every rank pads to the
largest count with -1 rows; the counts come from the step's lockstep vote (passed in), so the
launch runs no collective but the all-gather itself.
Traffic grows with ``ep_size * T`` whatever the routing, and the fp32 partial is
``[ep_size * T_max, H]``: fine for a couple of ranks, a reference for the all-to-all backends.
The contract shared by all expert-parallel backends is in :mod:`widellm.layers.moe.dispatch_ep`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from widellm.distributed.collectives import all_gather_single, reduce_scatter_single
from widellm.layers.moe.comm_tracking import TrackedWork, track
from widellm.layers.moe.dispatch import CombineHandle, DispatchedTokens, DispatchHandle
from widellm.layers.moe.dispatch_ep import ExpertParallelDispatcher, RowCodec


@dataclass
class _AllGatherDispatchHandle(DispatchHandle):
    work: TrackedWork
    codec: RowCodec
    # [ep_size * max_tokens, row_bytes] every rank's packed tokens, rank r's at r * max_tokens.
    gathered: torch.Tensor
    num_tokens: int
    max_tokens: int
    out_dtype: torch.dtype
    # Set by dispatch_wait: [N] gathered token of each local row and its fp32 gate weight.
    token_index: torch.Tensor | None = None
    row_weights: torch.Tensor | None = None


@dataclass
class _AllGatherCombineHandle(CombineHandle):
    work: TrackedWork
    # [max_tokens, H] fp32 sums for this rank's tokens (once work is done).
    summed: torch.Tensor
    num_tokens: int
    out_dtype: torch.dtype


class AllGatherDispatcher(ExpertParallelDispatcher):
    """All-gather dispatch, reduce-scatter combine.

    Args:
        expert_map: ``[E_phys]`` int64, contiguous by rank (see :mod:`.dispatch_ep`).
        group: the expert-parallel process group.
    """

    def dispatch_launch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        num_tokens_across_ranks: Sequence[int] | None = None,
    ) -> DispatchHandle:
        num_tokens, top_k = topk_ids.shape
        device = hidden_states.device
        max_tokens = max(self.token_counts(num_tokens, num_tokens_across_ranks))

        codec = RowCodec(hidden_states.shape[-1], hidden_states.dtype, num_slots=top_k)
        send = codec.empty(max_tokens, device)
        # Pad rows: ids -1 so no rank computes them; zeros elsewhere so no garbage travels.
        send[num_tokens:].zero_()
        codec.ids(send)[num_tokens:] = -1
        codec.hidden(send)[:num_tokens] = hidden_states
        codec.ids(send)[:num_tokens] = topk_ids
        codec.weights(send)[:num_tokens] = self.masked_weights(topk_ids, topk_weights)
        gathered = codec.empty(self.ep_size * max_tokens, device)
        work = track(all_gather_single(gathered, send, group=self.group, async_op=True))
        return _AllGatherDispatchHandle(
            work=work, codec=codec, gathered=gathered, num_tokens=num_tokens,
            max_tokens=max_tokens, out_dtype=hidden_states.dtype,
        )

    def dispatch_wait(self, handle: DispatchHandle) -> DispatchedTokens:
        assert isinstance(handle, _AllGatherDispatchHandle)
        handle.work.wait()
        codec, gathered = handle.codec, handle.gathered
        ids = codec.ids(gathered)
        # -1 // S is -1, so padding never matches a rank. nonzero sizes its output: host sync.
        token, slot = (ids // self.experts_per_rank == self.ep_rank).nonzero(as_tuple=True)
        handle.token_index = token
        handle.row_weights = codec.weights(gathered)[token, slot]
        return DispatchedTokens(
            hidden_states=codec.hidden(gathered).index_select(0, token),
            expert_ids=ids[token, slot] % self.experts_per_rank,
            topk_weights=handle.row_weights,
        )

    def combine_launch(self, expert_output: torch.Tensor, handle: DispatchHandle) -> CombineHandle:
        assert isinstance(handle, _AllGatherDispatchHandle)
        assert handle.token_index is not None and handle.row_weights is not None, "dispatch_wait first"
        hidden_size = expert_output.shape[-1]
        partial = torch.zeros(
            self.ep_size * handle.max_tokens, hidden_size, dtype=torch.float32,
            device=expert_output.device,
        )
        # bf16 rows times fp32 weights promote to fp32: weighted in fp32 with one temporary.
        partial.index_add_(0, handle.token_index, expert_output * handle.row_weights.unsqueeze(1))
        summed = partial.new_empty(handle.max_tokens, hidden_size)
        work = track(reduce_scatter_single(summed, partial, group=self.group, async_op=True))
        return _AllGatherCombineHandle(
            work=work, summed=summed, num_tokens=handle.num_tokens, out_dtype=handle.out_dtype
        )

    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        assert isinstance(handle, _AllGatherCombineHandle)
        handle.work.wait()
        return handle.summed[:handle.num_tokens].to(handle.out_dtype)
