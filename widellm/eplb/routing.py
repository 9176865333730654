"""Logical -> physical expert ids: send each routed token to one replica of its expert.

The replica is chosen by the token's *occurrence index* among this batch's selections of the
same expert (the n-th selection of expert e, in token-major order, goes to replica
``(n + offset) mod replica_count[e]``), not by the token index itself: ``t mod c`` is only
even when every token picks the expert, while the occurrence index gives each replica of a hot
expert the same number of tokens to within one whichever tokens picked it. ``offset`` lets
ranks that route their own batches (data parallel) start on different replicas, so that small
per-rank batches do not all land on replica 0.

Everything is fixed-shape torch ops (a stable sort and a searchsorted, no Python loop over
tokens, no data-dependent sizes), so it runs on any device and inside CUDA graphs.
"""

from __future__ import annotations

import torch


def logical_to_physical_ids(
    topk_ids: torch.Tensor,
    logical_to_phys: torch.Tensor,
    logical_replica_count: torch.Tensor,
    offset: int = 0,
) -> torch.Tensor:
    """Map the router's logical expert ids onto physical slots.

    Args:
        topk_ids: ``[T, k]`` int logical expert ids; ``-1`` marks padding.
        logical_to_phys: ``[num_logical, max_replicas]`` int64 slots of each expert's
            replicas (``-1`` padded), one layer of :func:`~widellm.eplb.planner.rebalance_experts`.
        logical_replica_count: ``[num_logical]`` replicas per expert (>= 1).
        offset: added to every occurrence index before the modulo (e.g. the DP rank).

    Returns:
        ``[T, k]`` physical slot ids with the dtype of ``topk_ids``; ``-1`` stays ``-1``.
    """
    flat = topk_ids.reshape(-1)
    padding = flat < 0
    # Stable sort keeps token-major order among the selections of one expert; a selection's
    # occurrence index is its position minus the position of the expert's first selection.
    sorted_ids, order = torch.sort(flat, stable=True)
    first = torch.searchsorted(sorted_ids, sorted_ids)
    occurrence = torch.empty_like(order)
    occurrence[order] = torch.arange(flat.numel(), device=flat.device) - first
    expert = flat.clamp(min=0).long()  # padding reads expert 0 and is masked below
    count = logical_replica_count.to(flat.device)[expert]
    replica = (occurrence + offset) % count
    physical = logical_to_phys.to(flat.device)[expert, replica]
    return torch.where(padding, -1, physical).to(topk_ids.dtype).view_as(topk_ids)
