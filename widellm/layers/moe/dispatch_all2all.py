"""``all2all``: variable-size all-to-all, each token sent once to every rank that holds one of
its experts.

Dispatch finds the (token, destination rank) pairs a batch needs, grouped by rank, exchanges
the per-destination counts (one small all-to-all and a host sync: split sizes are host
integers), then moves one packed row per pair in one all-to-all: the hidden vector once, with
the token's k local expert ids and gate weights (-1 / 0 for the slots another rank serves).
A token routed to several experts of one rank crosses the wire once, not once per expert (at
EP2 with top-6 of 64, about a third of the bytes). The receiving rank expands each row to its
k slots for the expert GEMMs, and in the combine takes the weighted fp32 sum over the slots it
served, sending back one fp32 partial per row; the home rank adds the partials of its ranks
in rank order.

Nothing is sent for padding and no rank receives rows it does not compute: the backend for
prefill-heavy batches. The host sync in dispatch rules it out of CUDA graphs; see
``all2all_fixed`` for decode. The contract shared by all expert-parallel backends is in
:mod:`widellm.layers.moe.dispatch_ep`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from widellm.layers.moe.dispatch import CombineHandle, DispatchedTokens, DispatchHandle
from widellm.layers.moe.dispatch_ep import ExpertParallelDispatcher, RowCodec, gather_weighted_sum


@dataclass
class _All2AllDispatchHandle(DispatchHandle):
    work: dist.Work
    codec: RowCodec
    # [n_recv, row_bytes] packed rows received (one per (token, this rank) pair of a peer).
    recv: torch.Tensor
    # [n_send] token of each row sent, in send order (grouped by destination rank).
    sent_tokens: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    out_dtype: torch.dtype


@dataclass
class _All2AllCombineHandle(CombineHandle):
    work: dist.Work
    # [n_send, H] fp32 partial sums for the rows this rank sent, in send order.
    back: torch.Tensor
    dispatch: _All2AllDispatchHandle


class All2AllDispatcher(ExpertParallelDispatcher):
    """Variable-split all-to-all dispatch and combine, one row per (token, rank) pair.

    Args:
        expert_map: ``[E_phys]`` int64, contiguous by rank (see :mod:`.dispatch_ep`).
        group: the expert-parallel process group.
    """

    def dispatch_launch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchHandle:
        num_tokens, top_k = topk_ids.shape
        device = hidden_states.device
        weights = self.masked_weights(topk_ids, topk_weights)
        # Destination rank of each slot; padding goes to a virtual rank past the last.
        dest = torch.where(topk_ids >= 0, topk_ids // self.experts_per_rank, self.ep_size)
        needs = torch.zeros(num_tokens, self.ep_size + 1, dtype=torch.bool, device=device)
        needs.scatter_(1, dest, True)
        needs = needs[:, :self.ep_size]
        send_counts = needs.sum(0)
        recv_counts = torch.empty_like(send_counts)
        counts_work = dist.all_to_all_single(recv_counts, send_counts, group=self.group,
                                             async_op=True)
        # (rank, token) of every row to send, sorted by rank then token.
        pairs = needs.t().nonzero()
        dest_rank, tokens = pairs[:, 0], pairs[:, 1]
        codec = RowCodec(hidden_states.shape[-1], hidden_states.dtype, num_slots=top_k)
        send = codec.empty(tokens.numel(), device)
        torch.index_select(hidden_states, 0, tokens, out=codec.hidden(send))
        served_there = dest.index_select(0, tokens) == dest_rank.unsqueeze(1)
        codec.ids(send)[:] = torch.where(
            served_there, topk_ids.index_select(0, tokens) % self.experts_per_rank, -1)
        codec.weights(send)[:] = torch.where(served_there, weights.index_select(0, tokens), 0.0)
        counts_work.wait()
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        recv = codec.empty(sum(recv_splits), device)
        work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group,
                                      async_op=True)
        return _All2AllDispatchHandle(
            work=work, codec=codec, recv=recv, sent_tokens=tokens, send_splits=send_splits,
            recv_splits=recv_splits, num_tokens=num_tokens, out_dtype=hidden_states.dtype,
        )

    def dispatch_wait(self, handle: DispatchHandle) -> DispatchedTokens:
        """Rows expanded to ``[n_recv * k]``: row ``i * k + j`` is received row ``i``'s slot
        ``j`` (expert id -1 where another rank serves that slot)."""
        assert isinstance(handle, _All2AllDispatchHandle)
        handle.work.wait()
        codec, recv = handle.codec, handle.recv
        num_rows, top_k = recv.shape[0], codec.num_slots
        hidden = codec.hidden(recv)
        expanded = hidden.unsqueeze(1).expand(num_rows, top_k, hidden.shape[-1])
        return DispatchedTokens(
            hidden_states=expanded.reshape(num_rows * top_k, hidden.shape[-1]),
            expert_ids=codec.ids(recv).reshape(-1).contiguous(),
            topk_weights=codec.weights(recv).reshape(-1).contiguous(),
        )

    def combine_launch(self, expert_output: torch.Tensor, handle: DispatchHandle) -> CombineHandle:
        assert isinstance(handle, _All2AllDispatchHandle)
        num_rows, top_k = handle.recv.shape[0], handle.codec.num_slots
        # Weighted fp32 sum over the slots this rank served, slot by slot.
        slot_rows = torch.arange(num_rows * top_k, device=expert_output.device)
        partial = gather_weighted_sum(expert_output, slot_rows.view(num_rows, top_k),
                                      handle.codec.weights(handle.recv))
        back = partial.new_empty(sum(handle.send_splits), partial.shape[-1])
        work = dist.all_to_all_single(back, partial, handle.send_splits, handle.recv_splits,
                                      group=self.group, async_op=True)
        return _All2AllCombineHandle(work=work, back=back, dispatch=handle)

    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        assert isinstance(handle, _All2AllCombineHandle)
        handle.work.wait()
        dispatch = handle.dispatch
        out = handle.back.new_zeros(dispatch.num_tokens, handle.back.shape[-1])
        # Rows were sent grouped by rank, so each token's partials add in rank order.
        out.index_add_(0, dispatch.sent_tokens, handle.back)
        return out.to(dispatch.out_dtype)
