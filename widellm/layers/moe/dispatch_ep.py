"""Pieces shared by the expert-parallel dispatch backends (``allgather_reducescatter``,
``all2all``, ``all2all_fixed``).

The contract every expert-parallel backend keeps:

- Constructor ``(expert_map, *, group)`` (``all2all_fixed`` adds ``capacity`` and
  ``max_tokens_per_rank``). ``ep_rank``/``ep_size`` come from ``group``, a
  ``torch.distributed`` process group (gloo on CPU, NCCL on GPU, same code).
- ``expert_map`` is ``[E_phys]`` int64 with ``E_phys = ep_size * S``: physical expert slots are
  laid out contiguously by rank, rank ``r`` owns physical ids ``[r*S, (r+1)*S)`` as local ids
  ``0..S-1`` in order, every other entry is -1. So the owner of a physical id is ``id // S``
  and its local id ``id % S``, computable on any rank without a table. Dispatchers only ever
  see *physical* ids; EPLB replicas of hot experts are just more physical slots.
- ``dispatch_launch(hidden [T, H], topk_ids [T, k] int64 physical ids or -1, topk_weights
  [T, k] fp32)``. ``T`` differs per rank and may be 0 or all padding (a rank with no work runs a
  dummy batch). Pairs with id -1 are never sent nor computed and contribute zero; their weights
  may be NaN, so they are cleared with ``masked_fill``, never multiplied away.
- ``dispatch_send(handle) -> bool``: a backend that exchanges sizes before rows (``all2all``)
  waits for the sizes and launches the rows here, returning True; the others return False.
- ``dispatch_wait -> DispatchedTokens(hidden_states [N, H], expert_ids [N] local id or -1,
  topk_weights [N] fp32)``. ``hidden_states`` may be a strided view of the receive buffer (row
  stride larger than ``H``).
- ``combine_launch(expert_output [N, H] unweighted, handle)``; ``combine_wait -> [T, H]`` in
  the hidden dtype: each token's weighted sum over its k experts, accumulated in fp32.
- Launch halves start ``async_op=True`` collectives and return handles, wait halves wait on
  them, so two micro-batches can interleave. Every rank calls the same collectives in the same
  order: any decision that changes which collectives run is taken from data all ranks share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from widellm.distributed.collectives import all_gather_single
from widellm.layers.moe.comm_tracking import TrackedWork, track
from widellm.layers.moe.dispatch import MoEDispatcher

# Packed rows keep every field aligned for ``Tensor.view(dtype)``: 8 bytes covers the int64
# ids and any hidden dtype.
_ALIGN = 8
_ID_BYTES = 8
_WEIGHT_BYTES = 4


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_ep_expert_map(expert_map: torch.Tensor, ep_rank: int, ep_size: int) -> int:
    """Check the contiguous-by-rank layout and return ``S``, the experts per rank.

    Raises:
        ValueError: when ``E_phys`` is not a positive multiple of ``ep_size`` or this rank's
            entries are not exactly ``-1 ... 0, 1, ..., S-1 ... -1`` at ``[r*S, (r+1)*S)``.
    """
    num_physical = expert_map.numel()
    if num_physical == 0 or num_physical % ep_size != 0:
        raise ValueError(
            f"expert_map has {num_physical} physical experts, not a positive multiple of "
            f"ep_size={ep_size}"
        )
    per_rank = num_physical // ep_size
    expected = torch.full((num_physical,), -1, dtype=torch.int64)
    expected[ep_rank * per_rank:(ep_rank + 1) * per_rank] = torch.arange(per_rank)
    if not torch.equal(expert_map.cpu(), expected):
        raise ValueError(
            f"expert_map of EP rank {ep_rank}/{ep_size} must map physical ids "
            f"[{ep_rank * per_rank}, {(ep_rank + 1) * per_rank}) to local ids 0..{per_rank - 1} "
            "in order and every other id to -1"
        )
    return per_rank


class RowCodec:
    """Layout of one packed row: ``num_slots`` int64 ids, ``num_slots`` fp32 weights, then the
    hidden vector, as raw bytes, so one collective moves all of a row's fields.

    A packed buffer is ``[n, row_bytes]`` uint8; the accessors return typed (strided) views of
    its columns, so writing a field writes the buffer in place.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, num_slots: int = 1) -> None:
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.num_slots = num_slots
        self._ids_end = num_slots * _ID_BYTES
        self._weights_end = self._ids_end + num_slots * _WEIGHT_BYTES
        self._hidden_start = _round_up(self._weights_end, _ALIGN)
        hidden_bytes = hidden_size * dtype.itemsize
        self.row_bytes = _round_up(self._hidden_start + hidden_bytes, _ALIGN)

    def empty(self, num_rows: int, device: torch.device) -> torch.Tensor:
        return torch.empty(num_rows, self.row_bytes, dtype=torch.uint8, device=device)

    def ids(self, buf: torch.Tensor) -> torch.Tensor:
        """``[n, num_slots]`` int64 view."""
        return buf[:, :self._ids_end].view(torch.int64)

    def weights(self, buf: torch.Tensor) -> torch.Tensor:
        """``[n, num_slots]`` fp32 view."""
        return buf[:, self._ids_end:self._weights_end].view(torch.float32)

    def hidden(self, buf: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` view in the hidden dtype."""
        end = self._hidden_start + self.hidden_size * self.dtype.itemsize
        return buf[:, self._hidden_start:end].view(self.dtype)


@dataclass
class DestinationOrder:
    """Every (token, slot) pair of a batch, stably sorted by the rank that owns its expert.

    Attributes:
        order: ``[T*k]`` int64 flat positions ``t*k + j``, sorted by destination; padding last.
        dest: ``[T*k]`` int64 destination rank of each sorted pair, ``ep_size`` for padding.
        rank_in_dest: ``[T*k]`` int64 index of each sorted pair inside its destination's block.
        counts: ``[ep_size]`` int64 pairs per destination rank, padding excluded (on device).
    """

    order: torch.Tensor
    dest: torch.Tensor
    rank_in_dest: torch.Tensor
    counts: torch.Tensor


def sort_by_destination(topk_ids: torch.Tensor, experts_per_rank: int, ep_size: int) -> DestinationOrder:
    """Group a batch's (token, slot) pairs by destination rank, without a host sync.

    Args:
        topk_ids: ``[T, k]`` int64 physical ids, -1 for padding.
    """
    flat = topk_ids.reshape(-1)
    # Padding goes to a virtual rank after the last one, so it sorts last and is counted apart.
    dest = torch.where(flat >= 0, flat // experts_per_rank, ep_size)
    order = torch.argsort(dest, stable=True)
    sorted_dest = dest[order]
    # scatter_add_ rather than bincount: bincount sizes its output from the data (a host sync
    # on GPU). An id past E_phys makes an out-of-range index here: an error, not a silent drop.
    counts = torch.zeros(ep_size + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, dest, torch.ones_like(dest))
    starts = counts.cumsum(0) - counts
    rank_in_dest = torch.arange(flat.numel(), device=flat.device) - starts[sorted_dest]
    return DestinationOrder(order=order, dest=sorted_dest, rank_in_dest=rank_in_dest, counts=counts[:ep_size])


def gather_weighted_sum(
    rows: torch.Tensor, pair_rows: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * rows[pair_rows[t, j]]``, accumulated in fp32 slot by slot.

    The same order of additions as :class:`LocalDispatcher`, so an expert-parallel combine
    rounds exactly like the single-rank one, deterministically (no atomics). Gathering one slot
    at a time keeps the operands contiguous (about twice as fast on CPU as a strided
    ``[T, k, H]`` view) and needs only ``[T, H]`` temporaries.

    Args:
        rows: ``[R, H]`` unweighted expert outputs; skipped pairs point at a zero row.
        pair_rows: ``[T, k]`` int64 row of each (token, slot) pair.
        weights: ``[T, k]`` fp32, 0 for skipped pairs.

    Returns:
        ``[T, H]`` fp32.
    """
    num_tokens, top_k = pair_rows.shape
    acc = torch.zeros(num_tokens, rows.shape[-1], dtype=torch.float32, device=rows.device)
    for slot in range(top_k):
        acc.addcmul_(rows.index_select(0, pair_rows[:, slot]), weights[:, slot:slot + 1])
    return acc


@dataclass
class VariableExchange:
    """A variable-split all-to-all of packed rows, in flight or done.

    Attributes:
        work: the rows' all-to-all.
        recv: ``[sum(recv_splits), row_bytes]`` uint8 packed rows received, by source rank.
        positions: ``[sum(send_splits)]`` int64 flat (``t*k + j``) position of each row sent, in
            send order; the combine's rows come back in this order.
        send_splits: rows sent to each rank; the combine receives this many back from each.
        recv_splits: rows received from each rank; the combine sends this many back to each.
    """

    work: TrackedWork
    recv: torch.Tensor
    positions: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]


def exchange_rows(
    codec: RowCodec,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: torch.Tensor,
    positions: torch.Tensor,
    send_counts: torch.Tensor,
    experts_per_rank: int,
    group: dist.ProcessGroup,
) -> VariableExchange:
    """Send (token, slot) pairs to their experts' ranks with variable split sizes.

    Exchanges the counts first (one small all-to-all and a host sync, since split sizes are
    host integers), packs the rows while the counts travel, then starts the rows' all-to-all.

    Args:
        hidden_states: ``[T, H]`` the batch's tokens.
        topk_ids: ``[T, k]`` int64 physical expert ids, -1 for padding.
        weights: ``[T, k]`` fp32 gate weights, 0 on padding.
        positions: ``[>= n]`` int64 flat positions of the pairs to send, grouped by destination
            rank; entries past the first ``n = send_counts.sum()`` are ignored (padding).
        send_counts: ``[ep_size]`` int64 pairs per destination rank.
    """
    recv_counts = torch.empty_like(send_counts)
    counts_work = track(dist.all_to_all_single(recv_counts, send_counts, group=group,
                                               async_op=True))
    send_splits = send_counts.tolist()
    positions = positions[:sum(send_splits)]
    send = codec.empty(positions.numel(), hidden_states.device)
    torch.index_select(hidden_states, 0, positions // topk_ids.shape[1], out=codec.hidden(send))
    codec.ids(send)[:, 0] = topk_ids.reshape(-1)[positions] % experts_per_rank
    codec.weights(send)[:, 0] = weights.reshape(-1)[positions]
    counts_work.wait()
    recv_splits = recv_counts.tolist()
    recv = codec.empty(sum(recv_splits), hidden_states.device)
    work = track(dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group,
                                        async_op=True))
    return VariableExchange(
        work=work, recv=recv, positions=positions, send_splits=send_splits, recv_splits=recv_splits
    )


def return_rows(
    expert_output: torch.Tensor, exchange: VariableExchange, group: dist.ProcessGroup
) -> tuple[torch.Tensor, TrackedWork]:
    """Send expert outputs back along ``exchange``'s reversed splits.

    Returns:
        ``(back, work)``: ``back [sum(send_splits) + 1, H]``, row ``i`` the output for the pair
        sent as row ``i`` (``exchange.positions[i]``) once ``work`` is done; the extra last row
        is zero, for gathers to read for pairs that were not sent.
    """
    num_sent = sum(exchange.send_splits)
    back = expert_output.new_empty(num_sent + 1, expert_output.shape[-1])
    back[num_sent].zero_()
    work = track(dist.all_to_all_single(
        back[:num_sent], expert_output.contiguous(), exchange.send_splits, exchange.recv_splits,
        group=group, async_op=True,
    ))
    return back, work


def dispatched_view(codec: RowCodec, recv: torch.Tensor):
    """``(hidden [n, H] strided view, expert_ids [n], weights [n])`` of received packed rows."""
    return codec.hidden(recv), codec.ids(recv)[:, 0].contiguous(), codec.weights(recv)[:, 0].contiguous()


class ExpertParallelDispatcher(MoEDispatcher):
    """Base of the expert-parallel backends: the group and the contiguous-by-rank layout.

    Args:
        expert_map: ``[E_phys]`` int64, see the module docstring for the required layout.
        group: the expert-parallel process group.

    Attributes:
        ep_rank, ep_size: this rank and the group size.
        experts_per_rank: ``S``; physical id ``p`` lives on rank ``p // S`` as local id ``p % S``.
    """

    def __init__(self, expert_map: torch.Tensor, *, group: dist.ProcessGroup) -> None:
        super().__init__(expert_map)
        self.group = group
        self.ep_rank = dist.get_rank(group)
        self.ep_size = dist.get_world_size(group)
        self.experts_per_rank = check_ep_expert_map(expert_map, self.ep_rank, self.ep_size)

    def token_counts(self, num_tokens: int, agreed: Sequence[int] | None) -> list[int]:
        """Every rank's token count for this call: ``agreed`` (checked) when the step's vote
        gave it, else agreed here with a blocking all-gather (outside an engine step)."""
        if agreed is None:
            counts = torch.zeros(self.ep_size, dtype=torch.int64)
            all_gather_single(counts, torch.tensor([num_tokens]), group=self.group)
            return counts.tolist()
        if len(agreed) != self.ep_size or agreed[self.ep_rank] != num_tokens:
            raise ValueError(f"agreed token counts {list(agreed)} do not fit EP rank "
                             f"{self.ep_rank}/{self.ep_size} with {num_tokens} tokens")
        return list(agreed)

    @staticmethod
    def masked_weights(topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``[T, k]`` fp32 weights, 0 on padding pairs (masked_fill: padding may hold NaN)."""
        return topk_weights.float().masked_fill(topk_ids < 0, 0.0)
