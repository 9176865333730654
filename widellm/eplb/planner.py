"""EPLB planning: place logical experts, with replicas of the hot ones, on physical slots.

Layout. ``num_slots`` physical expert slots are split contiguously over ``num_ranks`` ranks:
rank ``r`` owns slots ``[r*S, (r+1)*S)`` with ``S = num_slots // num_ranks``, and node ``n``
owns ranks ``[n*Rn, (n+1)*Rn)`` with ``Rn = num_ranks // num_nodes``. Every logical expert
gets at least one slot; the ``num_slots - num_logical`` redundant slots hold extra replicas.

Policy (:func:`rebalance_experts`), per layer. Hierarchical when ``num_groups`` divides by
``num_nodes`` (and ``num_logical`` by ``num_groups``), so that the experts of a group, which
group-limited routing selects together, stay on one node and a token's traffic crosses few
nodes:

a. pack the expert groups onto nodes, ``num_groups / num_nodes`` each, balancing the summed
   group load;
b. inside each node, hand its ``num_slots/num_nodes - experts on the node`` redundant slots out
   one at a time, each to the expert with the highest load per replica;
c. pack the node's replicas onto its ranks, ``S`` each, balancing the load per replica and
   avoiding two replicas of one expert on a rank when another rank with room has none.

Otherwise the global policy runs the same steps with one group and one node. Every packing is
the greedy one: items by weight, heaviest first, each into the lightest pack that still has
room. Ties go to the lower index (stable sorts, first minimum), so plans are deterministic.
Inside a rank, slots are ordered by logical expert id.

Example (hierarchical; 12 experts in 4 groups of 3, 16 slots, 2 nodes, 8 ranks, so 2 slots a
rank and 2 redundant slots a node), one layer with load
``[90, 10, 20, 5, 5, 5, 30, 40, 10, 8, 6, 4]``:

a. group loads ``[120, 15, 80, 18]``; heaviest first: g0 -> node 0, g2 -> node 1, g3 -> node 1
   (80 < 120), g1 -> node 0 (node 1 is full). Node 0 holds experts 0-5, node 1 experts 6-11.
b. node 0: expert 0 (90) gets both extra slots (90 -> 45 per replica, still the highest), so
   3 replicas of 30. Node 1: expert 7 (40 -> 20), then expert 6 (30 -> 15).
c. node 0 items 30,30,30 (e0), 20 (e2), 10 (e1), 5,5,5 (e3,e4,e5): the three e0 go to ranks
   0,1,2, e2 to rank 3, e1 to rank 3 (lightest), e3,e4,e5 to ranks 0,1,2.
   Node 1 items 20,20 (e7), 15,15 (e6), 10 (e8), 8 (e9), 6 (e10), 4 (e11): ranks 4,5 take e7,
   6,7 take e6, e8 -> 6, e9 -> 7, e10 -> 4, e11 -> 5.

giving ``phys_to_logical = [0,3, 0,4, 0,5, 1,2, 7,10, 7,11, 6,8, 6,9]`` (two slots per rank),
``logical_replica_count = [3,1,1,1,1,1, 2,2,1,1,1,1]``, ``logical_to_phys[0] = [0,2,4,-1,-1]``
and rank loads ``[35,35,35,30, 26,24,25,23]`` (balancedness 29.1/35 = 0.83).
"""

from __future__ import annotations

import torch

# Marks an unused entry of logical_to_phys (an expert with fewer replicas than the maximum).
NO_SLOT = -1


def balanced_packing(
    weights: torch.Tensor, num_packs: int, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """Greedy balanced packing of ``n`` items into ``num_packs`` packs of ``n // num_packs``.

    Items are taken heaviest first (ties: lower index first); each goes to the lightest pack
    that still has room (ties: lower pack). With ``labels``, a pack that already holds an item
    of the same label is passed over while some other pack with room holds none, so replicas
    of one expert land on different ranks whenever that is possible at that point.

    Args:
        weights: ``[B, n]`` float item weights; each of the B rows is packed independently.
        num_packs: number of packs; must divide ``n``.
        labels: optional ``[B, n]`` int64 labels in ``[0, n)``.

    Returns:
        ``[B, n]`` int64 pack index of every item.
    """
    batch, num_items = weights.shape
    if num_packs < 1 or num_items % num_packs != 0:
        raise ValueError(f"num_packs={num_packs} must divide the {num_items} items")
    capacity = num_items // num_packs
    rows = torch.arange(batch)
    order = torch.sort(weights, dim=1, descending=True, stable=True).indices
    pack_of = torch.empty(batch, num_items, dtype=torch.int64)
    pack_weight = torch.zeros(batch, num_packs, dtype=weights.dtype)
    pack_size = torch.zeros(batch, num_packs, dtype=torch.int64)
    # pack_has[b, p, label]: pack p of row b already holds an item with this label.
    pack_has = torch.zeros(batch, num_packs, num_items if labels is not None else 1, dtype=torch.bool)
    # One step per item position, vectorised over the B rows (layers x nodes).
    for step in range(num_items):
        item = order[:, step]
        allowed = pack_size < capacity
        if labels is not None:
            label = labels[rows, item]
            fresh = allowed & ~pack_has[rows, :, label]
            allowed = torch.where(fresh.any(dim=1, keepdim=True), fresh, allowed)
        cost = torch.where(allowed, pack_weight, torch.inf)
        pack = cost.argmin(dim=1)  # first minimum: lower pack wins ties
        pack_of[rows, item] = pack
        pack_weight[rows, pack] += weights[rows, item]
        pack_size[rows, pack] += 1
        if labels is not None:
            pack_has[rows, pack, label] = True
    return pack_of


def replicate_experts(load: torch.Tensor, num_redundant: int) -> torch.Tensor:
    """Replica counts: each of ``num_redundant`` extra slots goes, one at a time, to the expert
    with the highest load per replica (ties: lower index).

    Args:
        load: ``[B, n]`` float expert load; each row is handled independently.
        num_redundant: extra slots per row (>= 0).

    Returns:
        ``[B, n]`` int64 replica counts, each >= 1, every row summing to ``n + num_redundant``.
    """
    rows = torch.arange(load.shape[0])
    count = torch.ones(load.shape, dtype=torch.int64)
    for _ in range(num_redundant):
        best = (load / count).argmax(dim=1)
        count[rows, best] += 1
    return count


def maps_from_phys_to_logical(
    phys_to_logical: torch.Tensor, num_logical: int, max_replicas: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse maps of a placement.

    Args:
        phys_to_logical: ``[L, num_slots]`` int64 logical expert held by each slot.
        num_logical: number of logical experts.
        max_replicas: width of ``logical_to_phys``; at least the largest replica count.

    Returns:
        ``(logical_to_phys [L, num_logical, max_replicas], logical_replica_count
        [L, num_logical])``, int64. Replica ``j`` of an expert is its ``j``-th slot in slot
        order; unused entries are ``-1``.
    """
    num_layers, num_slots = phys_to_logical.shape
    count = torch.zeros(num_layers, num_logical, dtype=torch.int64)
    count.scatter_add_(1, phys_to_logical, torch.ones_like(phys_to_logical))
    if int(count.max()) > max_replicas:
        raise ValueError(f"max_replicas={max_replicas} is below the largest replica count {int(count.max())}")
    # Stable sort by expert keeps each expert's slots in slot order.
    sorted_logical, slot = torch.sort(phys_to_logical, dim=1, stable=True)
    first = torch.cumsum(count, dim=1) - count
    replica = torch.arange(num_slots).expand(num_layers, -1) - first.gather(1, sorted_logical)
    logical_to_phys = torch.full((num_layers, num_logical, max_replicas), NO_SLOT, dtype=torch.int64)
    layer = torch.arange(num_layers).unsqueeze(1).expand(-1, num_slots)
    logical_to_phys[layer, sorted_logical, replica] = slot
    return logical_to_phys, count


def _check_args(load: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_ranks: int) -> None:
    if load.dim() != 2 or load.shape[1] < 1:
        raise ValueError(
            f"load must be [num_layers, num_logical] with num_logical >= 1, got {tuple(load.shape)}"
        )
    if load.is_floating_point() and not bool(torch.isfinite(load).all()):
        raise ValueError("load must be finite")
    if bool((load < 0).any()):
        raise ValueError("load must be non-negative")
    num_logical = load.shape[1]
    if num_slots < num_logical:
        raise ValueError(f"num_slots={num_slots} must be >= num_logical={num_logical}")
    if num_ranks < 1 or num_slots % num_ranks != 0:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1 and divide num_slots={num_slots}")
    if num_nodes < 1 or num_ranks % num_nodes != 0:
        raise ValueError(f"num_nodes={num_nodes} must be >= 1 and divide num_ranks={num_ranks}")
    if num_groups < 1:
        raise ValueError(f"num_groups={num_groups} must be >= 1")


def is_hierarchical(num_logical: int, num_groups: int, num_nodes: int) -> bool:
    """Whether :func:`rebalance_experts` keeps groups on nodes (else it plans globally)."""
    return num_groups % num_nodes == 0 and num_logical % num_groups == 0


def rebalance_experts(
    load: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plan the placement of logical experts on physical slots (see the module docstring).

    Args:
        load: ``[num_layers, num_logical]`` measured load (token counts or any non-negative
            weight, int or float; only ratios matter).
        num_slots: physical expert slots per layer, over all ranks (>= num_logical).
        num_groups: expert groups (group-limited routing); ``num_logical`` splits into
            contiguous groups of ``num_logical // num_groups``.
        num_nodes: nodes; each owns a contiguous run of ``num_ranks // num_nodes`` ranks.
        num_ranks: expert-parallel ranks; each owns ``num_slots // num_ranks`` slots.

    Returns:
        ``(phys_to_logical [num_layers, num_slots], logical_to_phys [num_layers, num_logical,
        max_replicas], logical_replica_count [num_layers, num_logical])``, int64 on CPU, with
        ``max_replicas = num_slots - num_logical + 1`` (the most any expert can get, so the
        shapes depend only on the configuration and maps can be swapped in place).
    """
    _check_args(load, num_slots, num_groups, num_nodes, num_ranks)
    num_layers, num_logical = load.shape
    if not is_hierarchical(num_logical, num_groups, num_nodes):
        num_groups, num_nodes = 1, 1
    load = load.detach().to("cpu", torch.float64)
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = groups_per_node * group_size
    slots_per_node = num_slots // num_nodes
    ranks_per_node = num_ranks // num_nodes

    # (a) groups -> nodes; each node's groups in ascending order, then their experts.
    group_load = load.reshape(num_layers, num_groups, group_size).sum(dim=2)
    group_node = balanced_packing(group_load, num_nodes)
    node_groups = torch.argsort(group_node * num_groups + torch.arange(num_groups), dim=1)
    node_experts = (node_groups.unsqueeze(2) * group_size + torch.arange(group_size)).reshape(
        num_layers * num_nodes, experts_per_node
    )  # [L*N, experts_per_node] logical ids; row l*N + n is node n of layer l
    node_load = load.repeat_interleave(num_nodes, dim=0).gather(1, node_experts)

    # (b) replicas inside each node.
    count = replicate_experts(node_load, slots_per_node - experts_per_node)
    # Replica k of the node belongs to local expert searchsorted(cumsum(count), k, right).
    ends = torch.cumsum(count, dim=1)
    replica_pos = torch.arange(slots_per_node).expand(ends.shape[0], -1).contiguous()
    replica_local = torch.searchsorted(ends, replica_pos, right=True)
    replica_weight = (node_load / count).gather(1, replica_local)

    # (c) replicas -> the node's ranks, then slots in rank order, by expert inside a rank.
    replica_rank = balanced_packing(replica_weight, ranks_per_node, labels=replica_local)
    slot_order = torch.argsort(replica_rank * experts_per_node + replica_local, dim=1, stable=True)
    node_slots = node_experts.gather(1, replica_local.gather(1, slot_order))
    phys_to_logical = node_slots.reshape(num_layers, num_slots)

    logical_to_phys, replica_count = maps_from_phys_to_logical(
        phys_to_logical, num_logical, num_slots - num_logical + 1
    )
    return phys_to_logical, logical_to_phys, replica_count


def identity_placement(num_layers: int, num_logical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unbalanced baseline: ``num_slots == num_logical``, slot ``i`` holds expert ``i``.

    Returns the same triple as :func:`rebalance_experts` (``max_replicas = 1``).
    """
    phys_to_logical = torch.arange(num_logical).expand(num_layers, -1).contiguous()
    return (
        phys_to_logical,
        phys_to_logical.unsqueeze(2).clone(),
        torch.ones(num_layers, num_logical, dtype=torch.int64),
    )


def rank_load(
    load: torch.Tensor, phys_to_logical: torch.Tensor, logical_replica_count: torch.Tensor, num_ranks: int
) -> torch.Tensor:
    """Expected load per rank when each expert's load is split evenly over its replicas.

    Args:
        load: ``[L, num_logical]`` load (int or float).
        phys_to_logical: ``[L, num_slots]``; ``num_slots`` must divide by ``num_ranks``.
        logical_replica_count: ``[L, num_logical]``.
        num_ranks: ranks; rank ``r`` owns the ``r``-th contiguous run of slots.

    Returns:
        ``[L, num_ranks]`` float64.
    """
    num_layers, num_slots = phys_to_logical.shape
    if num_ranks < 1 or num_slots % num_ranks != 0:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1 and divide num_slots={num_slots}")
    per_replica = load.to(torch.float64) / logical_replica_count.to(load.device)
    slot_load = per_replica.gather(1, phys_to_logical.to(load.device))
    return slot_load.view(num_layers, num_ranks, num_slots // num_ranks).sum(dim=2)


def balancedness(load_per_rank: torch.Tensor) -> torch.Tensor:
    """Mean over max of the load per rank along the last dim (1.0 = perfect balance).

    Args:
        load_per_rank: ``[..., num_ranks]`` non-negative load.

    Returns:
        ``[...]`` float; 1.0 where every rank has zero load (nothing to balance).
    """
    load_per_rank = load_per_rank.to(torch.float64)
    peak = load_per_rank.amax(dim=-1)
    mean = load_per_rank.mean(dim=-1)
    # Clamping keeps the all-zero rows (answered 1.0) from producing 0/0 warnings or NaNs.
    ratio = mean / peak.clamp(min=torch.finfo(torch.float64).tiny)
    return torch.where(peak > 0, ratio, torch.ones_like(peak))
