"""EPLB weight moves: exact plans on hand-made placements, and real moves over 2 and 4 gloo
ranks between planner placements, checked slot by slot."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks
from widellm.eplb.executor import LayerMovePlan, move_layer_weights, plan_layer_moves
from widellm.eplb.planner import identity_placement, rebalance_experts

RUN_TIMEOUT_S = 60.0

# The example of LayerMovePlan's docstring: 8 slots on 4 ranks.
OLD = [0, 1, 2, 3, 0, 4, 3, 5]
NEW = [0, 1, 0, 2, 4, 5, 0, 3]


def simulate(plan: LayerMovePlan, old: list[int]) -> list[int]:
    """Apply a plan to per-slot expert ids, the way move_layer_weights applies it to weights;
    also checks that senders and receivers agree row by row."""
    spr, num_ranks = plan.slots_per_rank, plan.num_ranks
    per_rank = [old[r * spr : (r + 1) * spr] for r in range(num_ranks)]
    out = [list(x) for x in per_rank]
    for r in range(num_ranks):
        for src, dst in plan.local_copies[r]:
            out[r][dst] = per_rank[r][src]
    for r in range(num_ranks):
        for src_rank, src_local, dst in plan.recvs[r]:
            # The row's position in src_rank's send list must match its position in ours.
            from_src = [m for m in plan.sends[src_rank] if m[1] == r]
            mine = [m for m in plan.recvs[r] if m[0] == src_rank]
            k = mine.index((src_rank, src_local, dst))
            assert from_src[k] == (src_local, r, dst)
            out[r][dst] = per_rank[src_rank][src_local]
        for src, dst in plan.dup_copies[r]:
            out[r][dst] = out[r][src]
    return [e for rank_slots in out for e in rank_slots]


# ---------------------------------------------------------------- plan unit tests


def test_plan_hand_checked_example():
    plan = plan_layer_moves(torch.tensor(OLD), torch.tensor(NEW), 4)
    assert plan.num_ranks == 4 and plan.slots_per_rank == 2
    # Rank 0: both slots unchanged, serves e0 to rank 3 (rank 0 is the holder closest after 3).
    # Rank 1: e0 remote from rank 2 (closest after 1), e2 local from its own slot 0.
    # Rank 2: e4 local from its slot 1, e5 remote from rank 3's slot 1.
    # Rank 3: e0 remote from rank 0, e3 local from its slot 0 (a replica of e3 dropped).
    assert plan.sends == (((0, 3, 0),), (), ((0, 1, 0),), ((1, 2, 1),))
    assert plan.recvs == ((), ((2, 0, 0),), ((3, 1, 1),), ((0, 0, 0),))
    assert plan.local_copies == ((), ((0, 1),), ((1, 0),), ((0, 1),))
    assert plan.dup_copies == ((), (), (), ())
    assert plan.has_remote_traffic and plan.num_remote == 3
    assert plan.send_splits(2) == [0, 1, 0, 0] and plan.recv_splits(2) == [0, 0, 0, 1]
    assert simulate(plan, OLD) == NEW


def test_plan_is_deterministic_and_accepts_lists():
    a = plan_layer_moves(torch.tensor(OLD), torch.tensor(NEW), 4)
    assert a == plan_layer_moves(OLD, NEW, 4) == plan_layer_moves(list(OLD), list(NEW), 4)


def test_unchanged_placement_moves_nothing():
    plan = plan_layer_moves(OLD, OLD, 4)
    assert not plan.has_remote_traffic
    assert plan.local_copies == plan.dup_copies == plan.recvs == ((), (), (), ())


def test_local_only_swap_has_no_remote_traffic():
    # Slots swapped inside ranks: every source is local, read from the old weights.
    plan = plan_layer_moves([0, 1, 2, 3], [1, 0, 3, 2], 2)
    assert not plan.has_remote_traffic
    assert plan.local_copies == (((1, 0), (0, 1)), ((1, 0), (0, 1)))
    assert simulate(plan, [0, 1, 2, 3]) == [1, 0, 3, 2]


def test_replica_gained_received_once_and_one_dropped():
    # e0 gains two replicas, both on rank 1 which did not hold it: one transfer, one dup copy.
    # e1's two replicas (slots 1 and 5) drop to one.
    old = [0, 1, 2, 3, 4, 1]
    new = [0, 1, 0, 0, 4, 2]
    plan = plan_layer_moves(old, new, 3)
    assert plan.sends == (((0, 1, 0),), ((0, 2, 1),), ())
    assert plan.recvs == ((), ((0, 0, 0),), ((1, 0, 1),))
    assert plan.dup_copies == ((), ((0, 1),), ())
    assert plan.local_copies == ((), (), ())
    assert simulate(plan, old) == new


def test_sources_spread_over_holders():
    # e0 is on ranks 0 and 2 of 4; every other slot gets e0 in the new placement. Ranks 1 and
    # 3 each pick the holder just after them, so each holder serves one copy.
    old = [0, 1, 2, 3, 0, 4, 5, 6]
    new = [0, 1, 0, 3, 0, 4, 0, 6]
    plan = plan_layer_moves(old, new, 4)
    assert plan.recvs[1] == ((2, 0, 0),) and plan.recvs[3] == ((0, 0, 0),)
    assert [len(s) for s in plan.sends] == [1, 0, 1, 0]


def test_random_planner_placements_simulate_exactly():
    gen = torch.Generator().manual_seed(1)
    for trial in range(30):
        num_ranks = [2, 4, 8][trial % 3]
        loads = torch.randint(1, 1000, (2, 16), generator=gen) ** 2  # skewed
        p2l_a = rebalance_experts(loads[:1], 24, 4, 1, num_ranks)[0][0]
        p2l_b = rebalance_experts(loads[1:], 24, 4, 1, num_ranks)[0][0]
        plan = plan_layer_moves(p2l_a, p2l_b, num_ranks)
        assert simulate(plan, p2l_a.tolist()) == p2l_b.tolist()
        spr = 24 // num_ranks
        for r in range(num_ranks):
            # At most one transfer per (destination rank, expert), and none if held locally.
            got = [int(p2l_a[src_rank * spr + src_local]) for src_rank, src_local, _ in plan.recvs[r]]
            assert len(got) == len(set(got))
            assert not set(p2l_a[r * spr : (r + 1) * spr].tolist()) & set(got)


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="in no slot"):
        plan_layer_moves([0, 1, 2, 3], [0, 1, 2, 4], 2)
    with pytest.raises(ValueError, match="divide"):
        plan_layer_moves([0, 1, 2], [0, 1, 2], 2)
    with pytest.raises(ValueError, match="slots"):
        plan_layer_moves([0, 1, 2, 3], [0, 1], 2)


def test_move_without_traffic_needs_no_process_group():
    # Local-only plan: a single process can apply it (no collective is issued).
    plan = plan_layer_moves([0, 1, 2, 3], [1, 1, 3, 2], 2)
    w = torch.arange(2 * 3, dtype=torch.float32).view(2, 3)
    before = w.clone()
    (out,) = move_layer_weights([w], plan, rank=0)
    assert torch.equal(out, torch.stack([before[1], before[1]]))
    assert torch.equal(w, before) and out.data_ptr() != w.data_ptr()


# ---------------------------------------------------------------- real moves over gloo ranks

SHAPE_W13 = (6, 4)  # [2I, H]
SHAPE_W2 = (4, 3)  # [H, I]


def expert_tensor(expert: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Weights that identify the expert: 8*e + a per-element pattern, exact in bf16 for e < 31."""
    n = 1
    for d in shape:
        n *= d
    return (8 * expert + torch.arange(n) % 8).to(dtype).view(shape)


def rank_weights(p2l: list[int], rank: int, spr: int) -> list[torch.Tensor]:
    """(w13 fp32 [S, 2I, H], w2 bf16 [S, H, I]) of rank's slots in the placement p2l."""
    experts = p2l[rank * spr : (rank + 1) * spr]
    w13 = torch.stack([expert_tensor(e, SHAPE_W13, torch.float32) for e in experts])
    w2 = torch.stack([expert_tensor(e, SHAPE_W2, torch.bfloat16) for e in experts])
    # w2 with transposed strides (same values): inputs need not be contiguous.
    return [w13, w2.transpose(1, 2).contiguous().transpose(1, 2)]


def placements(world_size: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(old, new) pairs: identity -> planned, planned -> planned, planned -> itself, and a
    local-only shuffle; 16 experts in 4 groups, 24 slots (16 when the old is identity)."""
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    ident = identity_placement(1, 16)[0][0].tolist()
    plain = rebalance_experts(torch.randint(1, 100, (1, 16), generator=gen) ** 3, 16, 4, 1, world_size)[0][0]
    pairs.append((ident, plain.tolist()))
    for _ in range(4):
        loads = torch.randint(1, 100, (2, 16), generator=gen) ** 3  # skewed loads
        a = rebalance_experts(loads[:1], 24, 4, 1, world_size)[0][0].tolist()
        b = rebalance_experts(loads[1:], 24, 4, 1, world_size)[0][0].tolist()
        pairs.append((a, b))
    # Hand-made: a rank gains two replicas of an expert it did not hold (one transfer, one
    # copy), a swap across ranks, an expert dropped.
    if world_size == 2:
        pairs.append(([0, 1, 2, 3], [2, 2, 0, 3]))
    else:
        pairs.append((OLD, NEW))
        pairs.append(([0, 1, 2, 3, 4, 5, 6, 7], [2, 2, 0, 3, 4, 4, 6, 1]))
    pairs.append((a, a))
    spr = 24 // world_size
    pairs.append((a, [e for r in range(world_size) for e in reversed(a[r * spr : (r + 1) * spr])]))
    return pairs


def _rank_move(rank: int, world_size: int, seed: int) -> list[tuple[int, int, int]]:
    """Apply every placement change of placements(); return (remote, local, dup) move counts
    over all ranks of each."""
    counts = []
    for old, new in placements(world_size, seed):
        spr = len(old) // world_size
        plan = plan_layer_moves(torch.tensor(old), torch.tensor(new), world_size)
        weights = rank_weights(old, rank, spr)
        before = [w.clone() for w in weights]
        outs = move_layer_weights(weights, plan, rank)
        expected = rank_weights(new, rank, spr)
        for out, exp, w, b in zip(outs, expected, weights, before):
            assert out.dtype == exp.dtype and out.shape == exp.shape
            assert torch.equal(out, exp), f"rank {rank}: {old} -> {new}"
            assert torch.equal(w, b), "input modified"
        counts.append((plan.num_remote, sum(map(len, plan.local_copies)), sum(map(len, plan.dup_copies))))
    return counts


@pytest.mark.parametrize("world_size", [2, 4])
def test_move_layer_weights_matches_new_placement(world_size):
    results = run_ranks(_rank_move, world_size, 7, timeout_s=RUN_TIMEOUT_S)
    # Every rank saw the same plans; the placements did exercise remote moves and the
    # no-traffic paths (same placement, local shuffle).
    assert all(r == results[0] for r in results)
    remote, local, dup = zip(*results[0])
    assert min(remote[:-2]) > 0 and remote[-2:] == (0, 0)
    assert local[-1] > 0 and max(dup) > 0
