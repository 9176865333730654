"""``all2all``: variable-size all-to-all, each token sent once to every rank that holds one of
its experts.

Dispatch finds the (token, destination rank) pairs a batch needs, grouped by rank, exchanges
the per-destination counts (one small all-to-all, started by the launch half;
``dispatch_send`` reads them, a host sync: split sizes are host integers), then moves one
packed row per pair in one all-to-all: the hidden vector once, with the token's k local
expert ids and gate weights (-1 / 0 for the slots another rank serves).
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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from widellm.layers.moe.comm_tracking import TrackedWork, track
from widellm.layers.moe.dispatch import CombineHandle, DispatchedTokens, DispatchHandle
from widellm.layers.moe.dispatch_ep import ExpertParallelDispatcher, RowCodec, gather_weighted_sum


@dataclass
class _All2AllDispatchHandle(DispatchHandle):
    counts_work: TrackedWork
    # [ep_size] int64 rows this rank sends each rank, and (once counts_work is done) receives.
    send_counts: torch.Tensor
    recv_counts: torch.Tensor
    # [T, ep_size] bool: token t has a slot served by rank r.
    needs: torch.Tensor
    # [T, k] int64 destination rank of each slot (ep_size for padding).
    dest: torch.Tensor
    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    # [T, k] fp32 gate weights, 0 on padding.
    weights: torch.Tensor
    codec: RowCodec
    # Set by dispatch_send:
    rows_work: TrackedWork | None = None
    # [n_recv, row_bytes] packed rows received (one per (token, this rank) pair of a peer).
    recv: torch.Tensor | None = None
    # [n_send] token of each row sent, in send order (grouped by destination rank).
    sent_tokens: torch.Tensor | None = None
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def out_dtype(self) -> torch.dtype:
        return self.hidden_states.dtype


@dataclass
class _All2AllCombineHandle(CombineHandle):
    work: TrackedWork
    # [n_send, H] fp32 partial sums for the rows this rank sent, in send order.
    back: torch.Tensor
    dispatch: _All2AllDispatchHandle


class All2AllDispatcher(ExpertParallelDispatcher):
    """Variable-split all-to-all dispatch and combine, one row per (token, rank) pair.

    The launch half only counts the rows for each rank and starts their exchange;
    ``dispatch_send`` packs the rows (its ``nonzero`` sizes them: a host sync on a GPU), reads
    the counts (a host sync: split sizes are host integers) and starts the rows' exchange; the
    wait half waits for the rows.

    Args:
        expert_map: ``[E_phys]`` int64, contiguous by rank (see :mod:`.dispatch_ep`).
        group: the expert-parallel process group.
    """

    def dispatch_launch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        num_tokens_across_ranks: Sequence[int] | None = None,
    ) -> DispatchHandle:
        num_tokens, top_k = topk_ids.shape
        weights = self.masked_weights(topk_ids, topk_weights)
        # Destination rank of each slot; padding goes to a virtual rank past the last.
        dest = torch.where(topk_ids >= 0, topk_ids // self.experts_per_rank, self.ep_size)
        needs = torch.zeros(num_tokens, self.ep_size + 1, dtype=torch.bool,
                            device=hidden_states.device)
        needs.scatter_(1, dest, True)
        needs = needs[:, :self.ep_size]
        send_counts = needs.sum(0)
        recv_counts = torch.empty_like(send_counts)
        counts_work = track(dist.all_to_all_single(recv_counts, send_counts, group=self.group,
                                                   async_op=True))
        codec = RowCodec(hidden_states.shape[-1], hidden_states.dtype, num_slots=top_k)
        return _All2AllDispatchHandle(
            counts_work=counts_work, send_counts=send_counts, recv_counts=recv_counts,
            needs=needs, dest=dest, hidden_states=hidden_states, topk_ids=topk_ids,
            weights=weights, codec=codec,
        )

    def dispatch_send(self, handle: DispatchHandle) -> bool:
        """Packs the rows (while the counts travel), waits for the counts, launches the rows."""
        assert isinstance(handle, _All2AllDispatchHandle)
        if handle.rows_work is not None:
            return False
        codec = handle.codec
        # (rank, token) of every row, sorted by rank, token.
        pairs = handle.needs.t().nonzero()
        dest_rank, tokens = pairs[:, 0], pairs[:, 1]
        send = codec.empty(tokens.numel(), handle.hidden_states.device)
        torch.index_select(handle.hidden_states, 0, tokens, out=codec.hidden(send))
        served_there = handle.dest.index_select(0, tokens) == dest_rank.unsqueeze(1)
        codec.ids(send)[:] = torch.where(
            served_there, handle.topk_ids.index_select(0, tokens) % self.experts_per_rank, -1)
        codec.weights(send)[:] = torch.where(
            served_there, handle.weights.index_select(0, tokens), 0.0)
        handle.counts_work.wait()
        send_splits, recv_splits = handle.send_counts.tolist(), handle.recv_counts.tolist()
        recv = codec.empty(sum(recv_splits), send.device)
        handle.rows_work = track(dist.all_to_all_single(recv, send, recv_splits, send_splits,
                                                        group=self.group, async_op=True))
        handle.recv, handle.sent_tokens = recv, tokens
        handle.send_splits, handle.recv_splits = send_splits, recv_splits
        return True

    def dispatch_wait(self, handle: DispatchHandle) -> DispatchedTokens:
        """Rows expanded to ``[n_recv * k]``: row ``i * k + j`` is received row ``i``'s slot
        ``j`` (expert id -1 where another rank serves that slot)."""
        assert isinstance(handle, _All2AllDispatchHandle)
        self.dispatch_send(handle)
        handle.rows_work.wait()
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
        assert handle.recv is not None, "dispatch_wait first"
        num_rows, top_k = handle.recv.shape[0], handle.codec.num_slots
        # Weighted fp32 sum over the slots this rank served, slot by slot.
        slot_rows = torch.arange(num_rows * top_k, device=expert_output.device)
        partial = gather_weighted_sum(expert_output, slot_rows.view(num_rows, top_k),
                                      handle.codec.weights(handle.recv))
        back = partial.new_empty(sum(handle.send_splits), partial.shape[-1])
        work = track(dist.all_to_all_single(back, partial, handle.send_splits,
                                            handle.recv_splits, group=self.group, async_op=True))
        return _All2AllCombineHandle(work=work, back=back, dispatch=handle)

    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        assert isinstance(handle, _All2AllCombineHandle)
        handle.work.wait()
        dispatch = handle.dispatch
        out = handle.back.new_zeros(dispatch.num_tokens, handle.back.shape[-1])
        # Rows were sent grouped by rank, so each token's partials add in rank order.
        out.index_add_(0, dispatch.sent_tokens, handle.back)
        return out.to(dispatch.out_dtype)
