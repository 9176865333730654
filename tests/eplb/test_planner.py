"""EPLB planner: invariants of every plan, a hand-worked placement, balance on skewed loads."""

from __future__ import annotations

import pytest
import torch

from widellm.eplb.planner import (
    balanced_packing,
    balancedness,
    identity_placement,
    is_hierarchical,
    maps_from_phys_to_logical,
    rank_load,
    rebalance_experts,
    replicate_experts,
)

# (num_logical, num_slots, num_groups, num_nodes, num_ranks); hierarchical and global mixed.
CONFIGS = [
    (12, 16, 4, 2, 8),
    (64, 80, 16, 2, 8),
    (64, 64, 8, 4, 8),  # no redundant slots
    (64, 96, 8, 2, 16),
    (64, 80, 4, 8, 8),  # 4 groups on 8 nodes: global
    (60, 72, 7, 2, 8),  # 7 groups do not divide 60 experts: global
    (6, 24, 3, 3, 3),  # more replicas than ranks on a node: duplicates unavoidable
]


def zipf_load(num_layers: int, num_logical: int, exponent: float, seed: int) -> torch.Tensor:
    """Token counts with a Zipf-like profile: the i-th hottest expert gets ~1/i**exponent, the
    ranking shuffled per layer, with 10% noise."""
    gen = torch.Generator().manual_seed(seed)
    profile = 1.0 / torch.arange(1, num_logical + 1, dtype=torch.float64) ** exponent
    perm = torch.stack([torch.randperm(num_logical, generator=gen) for _ in range(num_layers)])
    noise = 1 + 0.1 * torch.rand(num_layers, num_logical, generator=gen, dtype=torch.float64)
    return (1e4 * profile[perm] * noise).round().to(torch.int64)


def hot_expert_load(num_layers: int, num_logical: int, num_hot: int, seed: int) -> torch.Tensor:
    """Uniform background of ~100 tokens with ``num_hot`` experts at 2000-5000 per layer."""
    gen = torch.Generator().manual_seed(seed)
    load = torch.randint(50, 150, (num_layers, num_logical), generator=gen)
    hot = torch.rand(num_layers, num_logical, generator=gen).argsort(dim=1)[:, :num_hot]
    return load.scatter(1, hot, torch.randint(2000, 5000, (num_layers, num_hot), generator=gen))


def check_plan(load, num_slots, num_groups, num_nodes, num_ranks, plan) -> None:
    """Exact invariants every plan must satisfy."""
    phys_to_logical, logical_to_phys, count = plan
    num_layers, num_logical = load.shape
    max_replicas = num_slots - num_logical + 1
    assert phys_to_logical.shape == (num_layers, num_slots)
    assert logical_to_phys.shape == (num_layers, num_logical, max_replicas)
    assert count.shape == (num_layers, num_logical)
    assert phys_to_logical.dtype == logical_to_phys.dtype == count.dtype == torch.int64
    assert bool((count >= 1).all())
    assert torch.equal(count.sum(dim=1), torch.full((num_layers,), num_slots))
    for layer in range(num_layers):
        for expert in range(num_logical):
            slots = logical_to_phys[layer, expert]
            n = int(count[layer, expert])
            # The first n entries are the expert's slots in ascending order, the rest -1.
            expected = (phys_to_logical[layer] == expert).nonzero().flatten()
            assert torch.equal(slots[:n], expected)
            assert bool((slots[n:] == -1).all())
    # Each slot appears in logical_to_phys exactly once, under the expert it holds.
    flat = logical_to_phys.flatten(1)
    for layer in range(num_layers):
        used = flat[layer][flat[layer] >= 0]
        assert torch.equal(used.sort().values, torch.arange(num_slots))
    # Ranks own equal contiguous runs of slots by layout; splitting each expert's load over its
    # replicas must neither lose nor invent load.
    per_rank = rank_load(load, phys_to_logical, count, num_ranks)
    assert per_rank.shape == (num_layers, num_ranks)
    assert torch.allclose(per_rank.sum(dim=1), load.double().sum(dim=1))
    if is_hierarchical(num_logical, num_groups, num_nodes):
        group_size = num_logical // num_groups
        slots_per_node = num_slots // num_nodes
        node_of_slot = torch.arange(num_slots) // slots_per_node
        groups_per_node = num_groups // num_nodes
        for layer in range(num_layers):
            group_of_slot = phys_to_logical[layer] // group_size
            for group in range(num_groups):
                nodes = node_of_slot[group_of_slot == group].unique()
                assert nodes.numel() == 1, f"group {group} spans nodes {nodes.tolist()}"
            for node in range(num_nodes):
                assert group_of_slot[node_of_slot == node].unique().numel() == groups_per_node


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kind", ["zipf", "hot", "zero", "uniform"])
def test_plan_invariants(config, kind):
    num_logical, num_slots, num_groups, num_nodes, num_ranks = config
    num_layers = 3
    if kind == "zipf":
        load = zipf_load(num_layers, num_logical, 1.2, seed=num_slots)
    elif kind == "hot":
        load = hot_expert_load(num_layers, num_logical, min(3, num_logical), seed=num_slots)
    elif kind == "zero":
        load = torch.zeros(num_layers, num_logical)
    else:
        load = torch.ones(num_layers, num_logical)
    plan = rebalance_experts(load, num_slots, num_groups, num_nodes, num_ranks)
    check_plan(load, num_slots, num_groups, num_nodes, num_ranks, plan)


@pytest.mark.parametrize("config", [(64, 96, 16, 2, 16), (64, 128, 8, 2, 8), (32, 64, 1, 1, 4)])
def test_replicas_spread_over_ranks(config):
    # An expert's replicas sit on as many different ranks as it has replicas, up to the ranks
    # of its node (beyond that, sharing a rank is unavoidable).
    num_logical, num_slots, num_groups, num_nodes, num_ranks = config
    ranks_per_node = num_ranks // num_nodes
    rank_of_slot = torch.arange(num_slots) // (num_slots // num_ranks)
    for load in (hot_expert_load(8, num_logical, 2, seed=3), zipf_load(8, num_logical, 1.5, seed=3)):
        phys_to_logical, _, count = rebalance_experts(load, num_slots, num_groups, num_nodes, num_ranks)
        assert int(count.max()) > ranks_per_node  # the unavoidable case is exercised too
        for layer in range(8):
            for expert in range(num_logical):
                ranks = rank_of_slot[phys_to_logical[layer] == expert].unique().numel()
                assert ranks == min(int(count[layer, expert]), ranks_per_node)


def test_hand_worked_placement():
    # 12 experts in 4 groups of 3 (g0 = 0-2, g1 = 3-5, g2 = 6-8, g3 = 9-11), 16 slots, 2 nodes,
    # 8 ranks: 2 slots a rank, 4 ranks and 8 slots a node, so 8 - 6 = 2 redundant slots a node.
    #
    # Layer 0, load [90,10,20, 5,5,5, 30,40,10, 8,6,4]:
    #  (a) group loads [120, 15, 80, 18]; heaviest first into the lightest node with room:
    #      g0 -> n0 (tie, lower), g2 -> n1, g3 -> n1 (80 < 120; n1 now full), g1 -> n0.
    #      n0 = experts 0-5 on ranks 0-3 (slots 0-7), n1 = experts 6-11 on ranks 4-7.
    #  (b) n0: e0 90 -> 2 replicas (45), still highest -> 3 replicas (30).
    #      n1: e7 40 -> 2 (20), then e6 30 > 20 -> 2 (15).
    #  (c) n0 items by weight: e0 30,30,30; e2 20; e1 10; e3,e4,e5 5.
    #      e0 -> r0; e0 -> r1, e0 -> r2 (r0 already holds e0); e2 -> r3 (0);
    #      e1 -> r3 (20 < 30); r3 full; e3 -> r0, e4 -> r1, e5 -> r2 (all 30, lower first).
    #      ranks: r0 {0,3} 35, r1 {0,4} 35, r2 {0,5} 35, r3 {1,2} 30.
    #      n1 items: e7 20,20; e6 15,15; e8 10; e9 8; e10 6; e11 4.
    #      e7 -> r4, e7 -> r5, e6 -> r6, e6 -> r7 (r6 holds e6); e8 -> r6 (15 < 20);
    #      e9 -> r7; e10 -> r4 (20, lower of r4/r5), e11 -> r5.
    #      ranks: r4 {7,10} 26, r5 {7,11} 24, r6 {6,8} 25, r7 {6,9} 23.
    #
    # Layer 1, load [20,20,20, 48,1,1, 60,31,9, 8,8,4]:
    #  (a) group loads [60, 50, 100, 20]: g2 -> n0, g0 -> n1, g1 -> n1 (60 < 100; full),
    #      g3 -> n0. So n0 = experts 6-11 (slots 0-7), n1 = experts 0-5 (slots 8-15).
    #  (b) n0: e6 60 -> 2 (30); then e7 31 > 30 -> 2 (15.5).
    #      n1: e3 48 -> 2 (24), 24 > 20 -> 3 (16).
    #  (c) n0 items: e6 30,30; e7 15.5,15.5; e8 9; e9 8; e10 8 (tie: e9 first); e11 4.
    #      e6 -> r0, e6 -> r1, e7 -> r2, e7 -> r3, e8 -> r2 (15.5, lower), e9 -> r3,
    #      e10 -> r0 (30, lower), e11 -> r1.
    #      ranks: r0 {6,10} 38, r1 {6,11} 34, r2 {7,8} 24.5, r3 {7,9} 23.5.
    #      n1 items: e0,e1,e2 20; e3 16,16,16; e4,e5 1.
    #      e0 -> r4, e1 -> r5, e2 -> r6, e3 -> r7, e3 -> r4 (skips r7, which holds e3),
    #      e3 -> r5; e4 -> r7 (16 < 20), e5 -> r6.
    #      ranks: r4 {0,3} 36, r5 {1,3} 36, r6 {2,5} 21, r7 {3,4} 17.
    load = torch.tensor(
        [
            [90, 10, 20, 5, 5, 5, 30, 40, 10, 8, 6, 4],
            [20, 20, 20, 48, 1, 1, 60, 31, 9, 8, 8, 4],
        ]
    )
    phys_to_logical, logical_to_phys, count = rebalance_experts(load, 16, 4, 2, 8)
    assert phys_to_logical.tolist() == [
        [0, 3, 0, 4, 0, 5, 1, 2, 7, 10, 7, 11, 6, 8, 6, 9],
        [6, 10, 6, 11, 7, 8, 7, 9, 0, 3, 1, 3, 2, 5, 3, 4],
    ]
    assert count.tolist() == [
        [3, 1, 1, 1, 1, 1, 2, 2, 1, 1, 1, 1],
        [1, 1, 1, 3, 1, 1, 2, 2, 1, 1, 1, 1],
    ]
    pad = [-1] * 5

    def row(*slots):
        return list(slots) + pad[len(slots) :]

    assert logical_to_phys.tolist() == [
        [row(0, 2, 4), row(6), row(7), row(1), row(3), row(5),
         row(12, 14), row(8, 10), row(13), row(15), row(9), row(11)],
        [row(8), row(10), row(12), row(9, 11, 14), row(15), row(13),
         row(0, 2), row(4, 6), row(5), row(7), row(1), row(3)],
    ]  # fmt: skip
    assert rank_load(load, phys_to_logical, count, 8).tolist() == [
        [35, 35, 35, 30, 26, 24, 25, 23],
        [38, 34, 24.5, 23.5, 36, 36, 21, 17],
    ]
    assert balancedness(rank_load(load, phys_to_logical, count, 8)).tolist() == pytest.approx(
        [233 / 8 / 35, 230 / 8 / 38]
    )
    check_plan(load, 16, 4, 2, 8, (phys_to_logical, logical_to_phys, count))


def test_global_policy_when_groups_do_not_divide_nodes():
    # 2 groups cannot be spread whole over 4 nodes: one pool of experts and of ranks.
    # 8 experts, 12 slots on 4 ranks (3 each), 4 redundant slots over all experts:
    #   e0 100 -> 2 (50); e1 60 > 50 -> 2 (30); e0 50 -> 3 (33.3); e0 33.3 > 30 -> 4 (25).
    #   Counts [4, 2, 1, 1, 1, 1, 1, 1].
    # Items heaviest first: e1 30,30; e0 25 x4; e2 10, e3 9, e4 8, e5 7, e6 6, e7 5.
    #   e1 -> r0, e1 -> r1 (r0 holds e1), e0 -> r2, e0 -> r3 (r2 holds e0),
    #   e0 -> r0 (r0/r1 tie at 30, lower), e0 -> r1 (the only rank with room and no e0);
    #   e2 -> r2 (25, lower of r2/r3), e3 -> r3, e4 -> r3 (34 < 35; full), e5 -> r2 (full),
    #   e6 -> r0 (55, lower), e7 -> r1.
    #   Ranks: r0 {0,1,6} 61, r1 {0,1,7} 60, r2 {0,2,5} 42, r3 {0,3,4} 42.
    # (The hierarchical policy with 2 nodes would keep e0 and e1, one group, on one node.)
    load = torch.tensor([[100, 60, 10, 9, 8, 7, 6, 5]])
    assert not is_hierarchical(8, 2, 4)
    plan = rebalance_experts(load, 12, 2, 4, 4)
    phys_to_logical, logical_to_phys, count = plan
    assert phys_to_logical.tolist() == [[0, 1, 6, 0, 1, 7, 0, 2, 5, 0, 3, 4]]
    assert count.tolist() == [[4, 2, 1, 1, 1, 1, 1, 1]]
    assert logical_to_phys[0, :2].tolist() == [[0, 3, 6, 9, -1], [1, 4, -1, -1, -1]]
    assert rank_load(load, phys_to_logical, count, 4).tolist() == [[61, 60, 42, 42]]
    check_plan(load, 12, 2, 4, 4, plan)
    # The same plan as asking for one group on one node explicitly.
    same = rebalance_experts(load, 12, 1, 1, 4)
    assert all(torch.equal(a, b) for a, b in zip(same, plan))


@pytest.mark.parametrize("config", [(64, 16, 2, 8), (64, 4, 8, 8), (128, 32, 4, 16)])
@pytest.mark.parametrize("redundant", ["none", "one_per_rank", "quarter"])
def test_not_worse_than_unbalanced_placement(config, redundant):
    num_logical, num_groups, num_nodes, num_ranks = config
    extra = {"none": 0, "one_per_rank": num_ranks, "quarter": num_logical // 4}[redundant]
    base_p2l, _, base_count = identity_placement(32, num_logical)
    loads = (zipf_load(32, num_logical, 1.0, seed=extra), hot_expert_load(32, num_logical, 4, seed=extra))
    for load in loads:
        plan = rebalance_experts(load, num_logical + extra, num_groups, num_nodes, num_ranks)
        planned = rank_load(load, plan[0], plan[2], num_ranks).amax(dim=1)
        unbalanced = rank_load(load, base_p2l, base_count, num_ranks).amax(dim=1)
        assert bool((planned <= unbalanced).all())


@pytest.mark.parametrize(
    "num_groups, num_nodes",
    [(16, 2), (1, 1), (4, 8)],  # hierarchical, global, global by fallback
)
def test_redundant_slots_balance_skewed_load(num_groups, num_nodes):
    # 64 experts on 8 ranks with 16 redundant slots (25%), Zipf 1.1 load, 32 layers.
    num_layers, num_logical, num_slots, num_ranks = 32, 64, 80, 8
    load = zipf_load(num_layers, num_logical, 1.1, seed=0)
    base_p2l, _, base_count = identity_placement(num_layers, num_logical)
    before = balancedness(rank_load(load, base_p2l, base_count, num_ranks))
    phys_to_logical, _, count = rebalance_experts(load, num_slots, num_groups, num_nodes, num_ranks)
    after = balancedness(rank_load(load, phys_to_logical, count, num_ranks))
    assert float(before.max()) < 0.5
    assert float(after.min()) >= 0.85


def test_balancedness():
    assert balancedness(torch.tensor([2.0, 2.0, 2.0])).item() == 1.0
    assert balancedness(torch.tensor([[4, 0, 0, 0]])).tolist() == [0.25]
    assert balancedness(torch.zeros(2, 3)).tolist() == [1.0, 1.0]


def test_building_blocks():
    # Packing: 6 items into 2 packs of 3; 9 -> p0, 8 -> p1, 7 -> p1 (8 < 9), 3 -> p0 (9 < 15),
    # 2 -> p0 (12 < 15), p0 full, 1 -> p1.
    weights = torch.tensor([[3.0, 9.0, 1.0, 8.0, 2.0, 7.0]])
    assert balanced_packing(weights, 2).tolist() == [[0, 0, 1, 1, 0, 1]]
    # Labels: 5 -> p0, 4 (label 1) -> p1; the second 4 would go to p1 (4 < 5), but p1
    # already holds label 1, so it goes to p0, and the 1 then fills p1.
    weights = torch.tensor([[5.0, 4.0, 4.0, 1.0]])
    assert balanced_packing(weights, 2).tolist() == [[0, 1, 1, 0]]
    labels = torch.tensor([[0, 1, 1, 2]])
    assert balanced_packing(weights, 2, labels).tolist() == [[0, 1, 0, 1]]
    assert replicate_experts(torch.tensor([[10.0, 4.0, 3.0]]), 3).tolist() == [[3, 2, 1]]
    l2p, count = maps_from_phys_to_logical(torch.tensor([[1, 0, 1, 2]]), 3, 2)
    assert l2p.tolist() == [[[1, -1], [0, 2], [3, -1]]]
    assert count.tolist() == [[1, 2, 1]]
    p2l, l2p, count = identity_placement(2, 3)
    assert p2l.tolist() == [[0, 1, 2]] * 2 and l2p.tolist() == [[[0], [1], [2]]] * 2
    assert count.tolist() == [[1, 1, 1]] * 2


@pytest.mark.parametrize(
    "args, name",
    [
        ((torch.ones(2, 8), 6, 1, 1, 2), "num_slots"),
        ((torch.ones(2, 8), 9, 1, 1, 2), "num_ranks"),
        ((torch.ones(2, 8), 8, 1, 3, 2), "num_nodes"),
        ((torch.ones(2, 8), 8, 0, 1, 2), "num_groups"),
        ((torch.ones(8), 8, 1, 1, 2), "load"),
        ((-torch.ones(2, 8), 8, 1, 1, 2), "load"),
        ((torch.full((2, 8), float("nan")), 8, 1, 1, 2), "load"),
    ],
)
def test_argument_validation(args, name):
    with pytest.raises(ValueError, match=name):
        rebalance_experts(*args)
