"""``all2all``: variable-size all-to-all, each (token, slot) pair sent once to its expert's rank.

Dispatch sorts the pairs by destination rank, exchanges the per-destination counts (one small
all-to-all and a host sync: split sizes are host integers), then moves the packed rows (hidden
vector, local expert id, gate weight) in one all-to-all with those split sizes. Combine sends
the unweighted expert outputs back along the reversed splits, and the home rank puts them back
in (token, slot) order and takes the weighted fp32 sum over each token's k slots.

Nothing is sent for padding and no rank receives more rows than it computes: the backend for
prefill-heavy batches. The host sync in dispatch rules it out of CUDA graphs; see
``all2all_fixed`` for decode. The contract shared by all expert-parallel backends is in
:mod:`widellm.layers.moe.dispatch_ep`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from widellm.layers.moe.dispatch import CombineHandle, DispatchedTokens, DispatchHandle
from widellm.layers.moe.dispatch_ep import (
    ExpertParallelDispatcher,
    RowCodec,
    VariableExchange,
    dispatched_view,
    exchange_rows,
    gather_weighted_sum,
    return_rows,
    sort_by_destination,
)


@dataclass
class _All2AllDispatchHandle(DispatchHandle):
    exchange: VariableExchange
    codec: RowCodec
    # [T*k] flat (t*k + j) positions sorted by destination: the first n_send were sent.
    order: torch.Tensor
    # [T, k] fp32 gate weights, 0 on padding.
    weights: torch.Tensor
    out_dtype: torch.dtype


@dataclass
class _All2AllCombineHandle(CombineHandle):
    work: dist.Work
    # [n_send + 1, H] outputs of the rows this rank sent, in send order, then a zero row.
    back: torch.Tensor
    dispatch: _All2AllDispatchHandle


class All2AllDispatcher(ExpertParallelDispatcher):
    """Variable-split all-to-all dispatch and combine.

    Args:
        expert_map: ``[E_phys]`` int64, contiguous by rank (see :mod:`.dispatch_ep`).
        group: the expert-parallel process group.
    """

    def dispatch_launch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchHandle:
        weights = self.masked_weights(topk_ids, topk_weights)
        routing = sort_by_destination(topk_ids, self.experts_per_rank, self.ep_size)
        codec = RowCodec(hidden_states.shape[-1], hidden_states.dtype)
        # Padding sorts last, and exchange_rows sends only the first counts.sum() positions.
        exchange = exchange_rows(
            codec, hidden_states, topk_ids, weights, routing.order, routing.counts,
            self.experts_per_rank, self.group,
        )
        return _All2AllDispatchHandle(
            exchange=exchange, codec=codec, order=routing.order, weights=weights,
            out_dtype=hidden_states.dtype,
        )

    def dispatch_wait(self, handle: DispatchHandle) -> DispatchedTokens:
        assert isinstance(handle, _All2AllDispatchHandle)
        handle.exchange.work.wait()
        hidden, expert_ids, weights = dispatched_view(handle.codec, handle.exchange.recv)
        return DispatchedTokens(hidden_states=hidden, expert_ids=expert_ids, topk_weights=weights)

    def combine_launch(self, expert_output: torch.Tensor, handle: DispatchHandle) -> CombineHandle:
        assert isinstance(handle, _All2AllDispatchHandle)
        back, work = return_rows(expert_output, handle.exchange, self.group)
        return _All2AllCombineHandle(work=work, back=back, dispatch=handle)

    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        assert isinstance(handle, _All2AllCombineHandle)
        handle.work.wait()
        dispatch = handle.dispatch
        num_tokens, top_k = dispatch.weights.shape
        num_sent = handle.back.shape[0] - 1
        # Row of each (token, slot) pair in `back`: the pair sent as row i reads row i, unsent
        # (padding) pairs read the zero row after the last; their weight is 0.
        pair_rows = torch.empty_like(dispatch.order)
        pair_rows[dispatch.order] = torch.arange(
            num_tokens * top_k, device=pair_rows.device
        ).clamp_(max=num_sent)
        out = gather_weighted_sum(handle.back, pair_rows.view(num_tokens, top_k), dispatch.weights)
        return out.to(dispatch.out_dtype)
