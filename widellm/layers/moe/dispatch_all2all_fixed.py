"""``all2all_fixed``: fixed-capacity all-to-all, static shapes for decode and CUDA graphs.

Each rank sends every other rank (itself included) a block of exactly ``capacity`` packed rows
(hidden vector, local expert id, gate weight); rows a block does not use carry expert id -1 and
zeros. One all-to-all with equal splits moves all blocks: no size exchange, every shape fixed
by ``ep_size`` and ``capacity``. Combine returns ``[ep_size * capacity, H]`` expert outputs the
same way, and the home rank takes the weighted fp32 sum over each token's k slots.

Overflow (more than ``capacity`` pairs from one rank for one destination) is never dropped:

- *Dynamic check* (the default): dispatch also all-reduces (MAX) the number of pairs that did
  not fit, and ``dispatch_wait`` reads it: one scalar all-reduce and one host sync per layer.
  The value is the same on every rank, so all ranks agree: if it is non-zero, every rank runs a
  spill round for the pairs that did not fit through a variable-split exchange of one row per
  pair (count exchange, rows' all-to-all; its outputs come back the same way in combine). The spill
  rows follow the fixed ones in the ``DispatchedTokens``.
- *Static guarantee*: when ``capacity >= T_max * min(top_k, S)``, with ``T_max`` the most
  tokens any rank holds in this call (the step's agreed counts, else ``max_tokens_per_rank``),
  no destination can get more pairs than fit (a token's k experts are distinct, so at most
  ``min(k, S)`` of them live on one rank), so the check, its all-reduce and its host sync are
  skipped: dispatch and combine are one all-to-all each, what a CUDA graph can capture (every
  decode step, with the default capacity). A batch above ``T_max`` raises ValueError, and
  repeated experts within a token (a broken router) trip a device-side assert instead of
  being dropped.

*Sized per step* (the default, off where decode graphs record the exchange): ``capacity`` is
the most a block holds; a call whose ranks agreed their token counts moves blocks of
:func:`step_capacity` rows, enough for the largest rank's tokens (rounded up to a power of two),
so a decode step of 32 tokens per rank does not move the 256-sequence buffers (gloo and NCCL
move the whole block, used or not: 8x the bytes at that size). Every rank derives the size from
the same agreed counts, so the blocks match. A CUDA graph records one shape while each rank
replays its own size, so an engine that captures graphs keeps the full capacity.

The contract shared by all expert-parallel backends is in :mod:`widellm.layers.moe.dispatch_ep`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from widellm.layers.moe.comm_tracking import TrackedWork, track
from widellm.layers.moe.dispatch import CombineHandle, DispatchedTokens, DispatchHandle
from widellm.layers.moe.dispatch_ep import (
    DestinationOrder,
    ExpertParallelDispatcher,
    RowCodec,
    VariableExchange,
    dispatched_view,
    exchange_rows,
    gather_weighted_sum,
    return_rows,
    sort_by_destination,
)


def step_capacity(capacity: int, max_tokens: int | None, rows_per_token: int) -> int:
    """Rows per block of a call whose largest rank holds ``max_tokens`` tokens (None: not
    agreed): ``capacity`` at most, else enough for that rank's worst case, its token count
    rounded up to a power of two (few distinct sizes recur) times the rows one token can need
    on one destination (``min(top_k, experts per rank)``).

    E.g. capacity 1536 (256 sequences x 6), 20 tokens, 6 rows per token: 32 x 6 = 192 rows.
    """
    if max_tokens is None:
        return capacity
    return min(capacity, (1 << max(max_tokens - 1, 0).bit_length()) * rows_per_token)


@dataclass
class _FixedDispatchHandle(DispatchHandle):
    work: TrackedWork
    # Rows per block of this call (see step_capacity).
    capacity: int
    codec: RowCodec
    # [ep_size * capacity, row_bytes] packed rows received, `capacity` per source rank.
    recv: torch.Tensor
    # [T*k] row of the fixed buffer each (token, slot) pair travels in; ep_size * capacity
    # (a zero row in the combine) for padding and for pairs that did not fit.
    pair_rows: torch.Tensor
    routing: DestinationOrder
    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    # [T, k] fp32 gate weights, 0 on padding.
    weights: torch.Tensor
    # Dynamic check only: [1] int64 max over ranks of pairs that did not fit, and its work.
    overflow: torch.Tensor | None
    overflow_work: TrackedWork | None
    # Set by dispatch_wait when some rank overflowed.
    spill: VariableExchange | None = None


@dataclass
class _FixedCombineHandle(CombineHandle):
    work: TrackedWork
    # [ep_size * capacity + 1, H] outputs of the rows this rank sent; the last row stays zero.
    back: torch.Tensor
    spill_work: TrackedWork | None
    # [n_spilled + 1, H] outputs of the spilled pairs, in spill order, then a zero row.
    spill_back: torch.Tensor | None
    dispatch: _FixedDispatchHandle


class FixedCapacityAll2AllDispatcher(ExpertParallelDispatcher):
    """Fixed-capacity all-to-all dispatch and combine.

    Args:
        expert_map: ``[E_phys]`` int64, contiguous by rank (see :mod:`.dispatch_ep`).
        group: the expert-parallel process group.
        capacity: rows per (source, destination) block.
        max_tokens_per_rank: the most tokens any rank passes to ``dispatch_launch``, if known;
            with a large enough ``capacity`` it turns the overflow check off (module docstring).
        size_per_step: move blocks sized for the call's agreed token counts (False: always
            ``capacity`` rows, the one shape a CUDA graph can record for every rank).
    """

    def __init__(
        self,
        expert_map: torch.Tensor,
        *,
        group: dist.ProcessGroup,
        capacity: int,
        max_tokens_per_rank: int | None = None,
        size_per_step: bool = True,
    ) -> None:
        super().__init__(expert_map, group=group)
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if max_tokens_per_rank is not None and max_tokens_per_rank < 0:
            raise ValueError(f"max_tokens_per_rank must be >= 0, got {max_tokens_per_rank}")
        self.capacity = capacity
        self.max_tokens_per_rank = max_tokens_per_rank
        self.size_per_step = size_per_step

    def overflow_impossible(self, top_k: int, counts: Sequence[int] | None = None) -> bool:
        """Whether ``capacity`` covers the worst case for ``top_k``, so the check is skipped:
        for any batch up to ``max_tokens_per_rank`` tokens, or for a call whose ranks agreed
        to hold ``counts`` tokens (a decode step's few rows fit where a prompt step's may not).

        Host arithmetic on constructor arguments, the batch's ``top_k`` and the agreed counts,
        identical on every rank, so all ranks make the same choice of collectives.
        """
        bound = self._token_bound(counts)
        if bound is None:
            return False
        return self.capacity >= bound * self.rows_per_token(top_k)

    def rows_per_token(self, top_k: int) -> int:
        """The most rows one token sends one rank: one per expert of its k held there."""
        return min(top_k, self.experts_per_rank)

    def _token_bound(self, counts: Sequence[int] | None) -> int | None:
        """The most tokens a rank holds in a call: the agreed counts' largest, else the
        constructor's promise (None: unknown)."""
        return max(counts) if counts else self.max_tokens_per_rank

    def capturable(self, counts: Sequence[int], top_k: int) -> bool:
        """Under the static bound and at the full capacity: one all-to-all per direction
        whose shape no rank's count changes."""
        return not self.size_per_step and self.overflow_impossible(top_k, counts)

    def dispatch_launch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        num_tokens_across_ranks: Sequence[int] | None = None,
    ) -> DispatchHandle:
        num_tokens, top_k = topk_ids.shape
        static = self.overflow_impossible(top_k, num_tokens_across_ranks)
        bound = self._token_bound(num_tokens_across_ranks)
        if static and num_tokens > bound:
            raise ValueError(f"{num_tokens} tokens > the {bound} the static capacity bound "
                             f"assumed")
        ep_size = self.ep_size
        capacity = (step_capacity(self.capacity, bound, self.rows_per_token(top_k))
                    if self.size_per_step and num_tokens_across_ranks else self.capacity)
        num_rows = ep_size * capacity
        weights = self.masked_weights(topk_ids, topk_weights)
        routing = sort_by_destination(topk_ids, self.experts_per_rank, ep_size)

        num_pairs = num_tokens * top_k
        device = hidden_states.device
        fits = (routing.dest < ep_size) & (routing.rank_in_dest < capacity)
        # Buffer row of each sorted pair; padding and pairs that did not fit go to a scratch
        # row past the end, never sent.
        rows = torch.where(fits, routing.dest * capacity + routing.rank_in_dest, num_rows)
        pair_rows = torch.empty_like(rows)
        pair_rows[routing.order] = rows
        # The pair that fills each buffer row, or num_pairs (an empty pair: zeros, id -1) for
        # unused rows; gathering from inputs extended by that empty entry fills each field of
        # the buffer in one pass, with no zero-fill and no [T*k, H] temporary.
        row_pairs = torch.full((num_rows + 1,), num_pairs, dtype=torch.int64, device=device)
        row_pairs.index_copy_(0, rows, routing.order)
        row_pairs = row_pairs[:num_rows]
        hidden_ext = torch.cat([hidden_states, hidden_states.new_zeros(1, hidden_states.shape[-1])])
        ids_ext = torch.cat([topk_ids.reshape(-1) % self.experts_per_rank, rows.new_full((1,), -1)])
        weights_ext = torch.cat([weights.reshape(-1), weights.new_zeros(1)])
        codec = RowCodec(hidden_states.shape[-1], hidden_states.dtype)
        send = codec.empty(num_rows, device)
        torch.index_select(hidden_ext, 0, row_pairs // top_k, out=codec.hidden(send))
        codec.ids(send)[:, 0] = ids_ext[row_pairs]
        codec.weights(send)[:, 0] = weights_ext[row_pairs]

        not_fitting = (routing.counts - capacity).clamp(min=0).sum().reshape(1)
        overflow = overflow_work = None
        if static:
            # A device-side check, no host sync: only a token repeating an expert gets here.
            torch._assert_async(
                not_fitting[0] == 0, "all2all_fixed: overflow despite the static capacity bound"
            )
        else:
            overflow = not_fitting
            overflow_work = track(dist.all_reduce(
                overflow, op=dist.ReduceOp.MAX, group=self.group, async_op=True
            ))
        recv = codec.empty(num_rows, device)
        work = track(dist.all_to_all_single(recv, send, group=self.group, async_op=True))
        return _FixedDispatchHandle(
            work=work, capacity=capacity, codec=codec, recv=recv, pair_rows=pair_rows,
            routing=routing,
            hidden_states=hidden_states, topk_ids=topk_ids, weights=weights,
            overflow=overflow, overflow_work=overflow_work,
        )

    def dispatch_wait(self, handle: DispatchHandle) -> DispatchedTokens:
        assert isinstance(handle, _FixedDispatchHandle)
        handle.work.wait()
        hidden, expert_ids, weights = dispatched_view(handle.codec, handle.recv)
        if handle.overflow_work is not None:
            handle.overflow_work.wait()
            # The host sync of the dynamic check; the value is the same on every rank.
            if int(handle.overflow) > 0:
                spill = self._spill(handle)
                spill_hidden, spill_ids, spill_weights = dispatched_view(handle.codec, spill.recv)
                hidden = torch.cat([hidden, spill_hidden])
                expert_ids = torch.cat([expert_ids, spill_ids])
                weights = torch.cat([weights, spill_weights])
        return DispatchedTokens(hidden_states=hidden, expert_ids=expert_ids, topk_weights=weights)

    def _spill(self, handle: _FixedDispatchHandle) -> VariableExchange:
        """Send the pairs that did not fit through the variable-split path; every rank calls
        this (possibly with nothing to send) once any rank overflowed."""
        routing = handle.routing
        left = (routing.dest < self.ep_size) & (routing.rank_in_dest >= handle.capacity)
        spill = exchange_rows(
            handle.codec, handle.hidden_states, handle.topk_ids, handle.weights,
            positions=routing.order[left],
            send_counts=(routing.counts - handle.capacity).clamp(min=0),
            experts_per_rank=self.experts_per_rank,
            group=self.group,
        )
        spill.work.wait()
        handle.spill = spill
        return spill

    def combine_launch(self, expert_output: torch.Tensor, handle: DispatchHandle) -> CombineHandle:
        assert isinstance(handle, _FixedDispatchHandle)
        num_rows = self.ep_size * handle.capacity
        back = expert_output.new_empty(num_rows + 1, expert_output.shape[-1])
        back[num_rows].zero_()
        work = track(dist.all_to_all_single(
            back[:num_rows], expert_output[:num_rows].contiguous(), group=self.group, async_op=True
        ))
        spill_back = spill_work = None
        if handle.spill is not None:
            spill_back, spill_work = return_rows(expert_output[num_rows:], handle.spill, self.group)
        return _FixedCombineHandle(
            work=work, back=back, spill_work=spill_work, spill_back=spill_back, dispatch=handle
        )

    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        assert isinstance(handle, _FixedCombineHandle)
        handle.work.wait()
        dispatch = handle.dispatch
        weights = dispatch.weights
        num_tokens, top_k = weights.shape
        rows, pair_rows = handle.back, dispatch.pair_rows
        if handle.spill_work is not None:
            handle.spill_work.wait()
            # Spilled pairs read their rows after the fixed ones; the zero row moves last.
            num_rows = self.ep_size * dispatch.capacity
            num_spilled = handle.spill_back.shape[0] - 1
            rows = torch.cat([handle.back[:num_rows], handle.spill_back])
            pair_rows = pair_rows.masked_fill(pair_rows == num_rows, num_rows + num_spilled)
            pair_rows[dispatch.spill.positions] = torch.arange(
                num_rows, num_rows + num_spilled, device=pair_rows.device
            )
        out = gather_weighted_sum(rows, pair_rows.view(num_tokens, top_k), weights)
        return out.to(dispatch.hidden_states.dtype)
