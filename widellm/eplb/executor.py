"""EPLB execution: move expert weights between ranks for a new placement, one layer at a time.

Layout. ``P`` physical slots over ``R`` EP ranks, rank ``r`` owning slots ``[r*S, (r+1)*S)``
with ``S = P // R``; a rank stores its slots' weights stacked, ``[S, ...]`` per tensor (e.g.
``w13_weight [S, 2I, H]``, ``w2_weight [S, H, I]``). A placement is ``phys_to_logical [P]``:
the logical expert whose weights each slot holds.

Two steps per layer:

1. :func:`plan_layer_moves` (pure, on host lists): every rank computes the same
   :class:`LayerMovePlan` from the same old and new maps, so no sizes are exchanged.
2. :func:`move_layer_weights` (collective): each rank builds NEW ``[S, ...]`` tensors for the
   new placement: unchanged slots and local moves are copies, remote ones arrive in one
   ``all_to_all_single`` whose split sizes every rank knows from the plan. The inputs are only
   read, so until the caller swaps in the outputs (after every rank succeeded) the old weights
   and the old routing maps stay consistent and serving continues on them.

Source rule for a slot whose expert ``e`` changes, on destination rank ``d``:

- ``d`` held ``e`` in the old placement: copy from its lowest such local slot (no traffic);
- else, if another changed slot of ``d`` already receives ``e``: copy from that slot after the
  receive (an expert crosses the network once per destination rank);
- else receive it from the old holder rank closest after ``d`` (smallest ``(h - d) mod R``),
  from that rank's lowest slot holding ``e``; destinations spread over the holders of a
  replicated expert instead of all reading from one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

# (src_local_slot, dst_rank, dst_local_slot)
Send = tuple[int, int, int]
# (src_rank, src_local_slot, dst_local_slot)
Recv = tuple[int, int, int]
# (src_local_slot, dst_local_slot)
Copy = tuple[int, int]


@dataclass(frozen=True)
class LayerMovePlan:
    """Who sends which slot where for one layer; identical on every rank.

    All slot numbers are local (``0..S-1`` inside their rank). Every field is a tuple with one
    entry per rank, each a tuple of moves:

    - ``sends[r]``: ``(src_local_slot, dst_rank, dst_local_slot)`` sorted by
      ``(dst_rank, dst_local_slot)``: the order of rows in ``r``'s all-to-all input.
    - ``recvs[r]``: ``(src_rank, src_local_slot, dst_local_slot)`` sorted by
      ``(src_rank, dst_local_slot)``: the order of rows in ``r``'s all-to-all output. Between
      one sender and one receiver both sides order by ``dst_local_slot``, so they agree.
    - ``local_copies[r]``: ``(src_local_slot, dst_local_slot)`` from ``r``'s OLD weights
      (the expert was already on ``r``), sorted by ``dst_local_slot``.
    - ``dup_copies[r]``: ``(src_local_slot, dst_local_slot)`` from ``r``'s NEW weights after
      the receive (a second slot of ``r`` wants an expert that ``r`` receives once), sorted by
      ``dst_local_slot``.

    Slots named nowhere are unchanged and keep their weights.

    Example (``P = 8`` slots, ``R = 4`` ranks, ``S = 2``)::

        old = [0, 1 | 2, 3 | 0, 4 | 3, 5]     new = [0, 1 | 0, 2 | 4, 5 | 0, 3]

    Rank 0 is unchanged. Rank 1 needs e0 (held by ranks 0 and 2; closest after 1 is 2) and e2
    (its own old local slot 0). Rank 2 needs e4 (own local slot 1) and e5 (rank 3's local 1).
    Rank 3 needs e0 (closest holder after 3 is rank 0) and e3 (own local slot 0). Replica
    counts go e0: 2 -> 3, e3: 2 -> 1. So::

        sends  = (((0, 3, 0),), (), ((0, 1, 0),), ((1, 2, 1),))
        recvs  = ((), ((2, 0, 0),), ((3, 1, 1),), ((0, 0, 0),))
        local_copies = ((), ((0, 1),), ((1, 0),), ((0, 1),))
        dup_copies   = ((), (), (), ())
    """

    num_ranks: int
    slots_per_rank: int
    sends: tuple[tuple[Send, ...], ...]
    recvs: tuple[tuple[Recv, ...], ...]
    local_copies: tuple[tuple[Copy, ...], ...]
    dup_copies: tuple[tuple[Copy, ...], ...]

    @property
    def has_remote_traffic(self) -> bool:
        """Whether any rank sends anything (if not, every rank skips the collective)."""
        return any(self.sends)

    @property
    def num_remote(self) -> int:
        """Slots moved across ranks, over all ranks."""
        return sum(len(s) for s in self.sends)

    def send_splits(self, rank: int) -> list[int]:
        """Rows ``rank`` sends to each rank (``input_split_sizes`` of the all-to-all)."""
        splits = [0] * self.num_ranks
        for _, dst_rank, _ in self.sends[rank]:
            splits[dst_rank] += 1
        return splits

    def recv_splits(self, rank: int) -> list[int]:
        """Rows ``rank`` receives from each rank (``output_split_sizes`` of the all-to-all)."""
        splits = [0] * self.num_ranks
        for src_rank, _, _ in self.recvs[rank]:
            splits[src_rank] += 1
        return splits


def _as_list(p2l: torch.Tensor | Sequence[int], name: str) -> list[int]:
    if isinstance(p2l, torch.Tensor):
        if p2l.dim() != 1:
            raise ValueError(f"{name} must be 1-D [num_slots], got shape {tuple(p2l.shape)}")
        return [int(x) for x in p2l.tolist()]
    return [int(x) for x in p2l]


def plan_layer_moves(
    old_p2l: torch.Tensor | Sequence[int], new_p2l: torch.Tensor | Sequence[int], num_ranks: int
) -> LayerMovePlan:
    """Plan the weight moves of one layer from ``old_p2l`` to ``new_p2l``.

    Deterministic: a function of its arguments only, so every rank computes the same plan
    (source rule in the module docstring, example in :class:`LayerMovePlan`).

    Args:
        old_p2l: ``[P]`` logical expert of each physical slot now (one layer's row of
            ``phys_to_logical``).
        new_p2l: ``[P]`` the same for the new placement; every expert in it must be in
            ``old_p2l`` (weights come only from other slots).
        num_ranks: EP ranks; must divide ``P``.

    Returns:
        The :class:`LayerMovePlan`.
    """
    old = _as_list(old_p2l, "old_p2l")
    new = _as_list(new_p2l, "new_p2l")
    if len(old) != len(new):
        raise ValueError(f"old_p2l has {len(old)} slots, new_p2l {len(new)}")
    if num_ranks < 1 or len(old) % num_ranks != 0:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1 and divide num_slots={len(old)}")
    spr = len(old) // num_ranks

    # holders[e][r] = lowest local slot of rank r holding e in the old placement.
    holders: dict[int, dict[int, int]] = {}
    for slot, expert in enumerate(old):
        holders.setdefault(expert, {}).setdefault(slot // spr, slot % spr)

    sends: list[list[Send]] = [[] for _ in range(num_ranks)]
    recvs: list[list[Recv]] = [[] for _ in range(num_ranks)]
    local_copies: list[list[Copy]] = [[] for _ in range(num_ranks)]
    dup_copies: list[list[Copy]] = [[] for _ in range(num_ranks)]
    for dst_rank in range(num_ranks):
        received: dict[int, int] = {}  # expert -> local slot of dst_rank that receives it
        for dst_local in range(spr):
            slot = dst_rank * spr + dst_local
            expert = new[slot]
            if expert == old[slot]:
                continue
            where = holders.get(expert)
            if where is None:
                raise ValueError(f"expert {expert} (new slot {slot}) is in no slot of old_p2l")
            if dst_rank in where:
                local_copies[dst_rank].append((where[dst_rank], dst_local))
            elif expert in received:
                dup_copies[dst_rank].append((received[expert], dst_local))
            else:
                src_rank = min(where, key=lambda h: (h - dst_rank) % num_ranks)
                src_local = where[src_rank]
                received[expert] = dst_local
                sends[src_rank].append((src_local, dst_rank, dst_local))
                recvs[dst_rank].append((src_rank, src_local, dst_local))

    # Destinations were visited in (dst_rank, dst_local) order, so sends are already sorted by
    # (dst_rank, dst_local_slot); recvs need (src_rank, dst_local_slot).
    for r in range(num_ranks):
        recvs[r].sort(key=lambda m: (m[0], m[2]))
    return LayerMovePlan(
        num_ranks=num_ranks,
        slots_per_rank=spr,
        sends=tuple(tuple(x) for x in sends),
        recvs=tuple(tuple(x) for x in recvs),
        local_copies=tuple(tuple(x) for x in local_copies),
        dup_copies=tuple(tuple(x) for x in dup_copies),
    )


def _slot_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[S, ...]`` contiguous tensor -> ``[S, nbytes_per_slot]`` uint8 view of its memory."""
    return t.view(t.shape[0], -1).view(torch.uint8)


@dataclass
class PreparedMove:
    """Everything one rank needs for a layer's exchange, allocated before any collective."""

    outs: list[torch.Tensor]  # the new weights, local copies applied, receives pending
    send_buf: torch.Tensor | None  # [sent rows, row bytes] uint8; None without remote traffic
    recv_buf: torch.Tensor | None  # [received rows, row bytes] uint8
    row_bytes: list[int]


def prepare_layer_move(
    weights: Sequence[torch.Tensor], plan: LayerMovePlan, rank: int
) -> PreparedMove:
    """The local half of a move: validate, allocate the new weights and the send/receive
    buffers, apply local copies. It may fail (bad input, out of memory) on one rank only;
    callers agree on success across ranks before :func:`exchange_layer_move`, so a failure
    here never leaves a peer waiting inside a collective.

    Args:
        weights: this rank's tensors, each ``[S, ...]`` (``S = plan.slots_per_rank``), all on
            one device; e.g. ``(w13_weight [S, 2I, H], w2_weight [S, H, I])``. Only read.
        plan: from :func:`plan_layer_moves`, the same on every rank.
        rank: this rank's index in the plan's rank numbering.
    """
    if not weights:
        raise ValueError("weights is empty")
    spr = plan.slots_per_rank
    device = weights[0].device
    for w in weights:
        if w.dim() < 1 or w.shape[0] != spr:
            raise ValueError(f"each weight must be [{spr}, ...], got shape {tuple(w.shape)}")
        if w.device != device:
            raise ValueError(f"weights are on {device} and {w.device}; expected one device")
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank={rank} is outside the plan's {plan.num_ranks} ranks")

    # A fresh contiguous copy keeps the unchanged slots and never aliases the input.
    outs = [w.clone(memory_format=torch.contiguous_format) for w in weights]
    if plan.local_copies[rank]:
        src = _index([s for s, _ in plan.local_copies[rank]], device)
        dst = _index([d for _, d in plan.local_copies[rank]], device)
        for w, out in zip(weights, outs):
            # As bytes: index_copy_ has no float8 kernel on CPU, and bytes are what moves.
            _slot_bytes(out).index_copy_(0, dst, _slot_bytes(w.contiguous()).index_select(0, src))
    row_bytes = [_slot_bytes(out).shape[1] for out in outs]
    send_buf = recv_buf = None
    if plan.has_remote_traffic:
        # Rows: one per moved slot, every tensor's slot bytes side by side.
        total = sum(row_bytes)
        sends, recvs = plan.sends[rank], plan.recvs[rank]
        if sends:
            src = _index([s for s, _, _ in sends], device)
            # From the inputs: outs may already hold local copies over a sent slot.
            send_buf = torch.cat([_slot_bytes(w.index_select(0, src)) for w in weights], dim=1)
        else:
            send_buf = torch.empty(0, total, dtype=torch.uint8, device=device)
        recv_buf = torch.empty(len(recvs), total, dtype=torch.uint8, device=device)
    return PreparedMove(outs, send_buf, recv_buf, row_bytes)


def exchange_layer_move(
    prepared: PreparedMove, plan: LayerMovePlan, rank: int,
    group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    """The collective half: one ``all_to_all_single`` of raw slot bytes (every rank of
    ``group`` calls it for the same layer, unless ``plan.has_remote_traffic`` is false, when
    none communicates), then the receives and the copies between new replicas. Returns the
    new weights.

    All tensors' slot rows travel as raw bytes in one uint8 collective, so tensors of
    different dtypes (bf16, fp8, fp32 scales, ...) share it and any backend that moves bytes
    works (gloo on CPU, NCCL on GPU).
    """
    outs = prepared.outs
    device = outs[0].device
    if plan.has_remote_traffic:
        if group is None and not dist.is_initialized():
            raise RuntimeError("the plan moves weights across ranks but no process group is set up")
        if dist.get_world_size(group) != plan.num_ranks or dist.get_rank(group) != rank:
            raise ValueError(
                f"group has rank {dist.get_rank(group)} of {dist.get_world_size(group)}, "
                f"the call says rank {rank} of {plan.num_ranks}"
            )
        recv_buf = prepared.recv_buf
        dist.all_to_all_single(
            recv_buf, prepared.send_buf, plan.recv_splits(rank), plan.send_splits(rank),
            group=group,
        )
        recvs = plan.recvs[rank]
        if recvs:
            dst = _index([d for _, _, d in recvs], device)
            offset = 0
            for out, nbytes in zip(outs, prepared.row_bytes):
                _slot_bytes(out).index_copy_(0, dst, recv_buf[:, offset : offset + nbytes])
                offset += nbytes

    if plan.dup_copies[rank]:
        src = _index([s for s, _ in plan.dup_copies[rank]], device)
        dst = _index([d for _, d in plan.dup_copies[rank]], device)
        for out in outs:
            _slot_bytes(out).index_copy_(0, dst, _slot_bytes(out).index_select(0, src))
    return outs


def move_layer_weights(
    weights: Sequence[torch.Tensor],
    plan: LayerMovePlan,
    rank: int,
    group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    """Build this rank's weights for the new placement of one layer (collective):
    :func:`prepare_layer_move` then :func:`exchange_layer_move`. The inputs are only read.

    Returns:
        New contiguous tensors, one per input, same shapes and dtypes, holding the new
        placement's experts in this rank's slots.
    """
    return exchange_layer_move(prepare_layer_move(weights, plan, rank), plan, rank, group)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
