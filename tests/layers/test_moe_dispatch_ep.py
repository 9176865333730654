"""Expert-parallel dispatch backends on 2 and 4 gloo ranks against the single-rank reference.

Every rank builds the same full expert weights and the same batches of all ranks (fixed
seeds), slices its own experts, and checks that dispatch -> experts -> combine over the group
gives, for its own tokens, what :class:`LocalDispatcher` with all experts local gives. Token
counts differ per rank; one rank has no tokens or only padding; some (token, slot) pairs are
-1 with NaN weights; routing is random or skewed onto one rank's experts.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import RankError, run_ranks
from widellm.layers.moe import (
    All2AllDispatcher,
    AllGatherDispatcher,
    DispatchedTokens,
    FixedCapacityAll2AllDispatcher,
    LocalDispatcher,
    MoEDispatcher,
    make_dispatcher,
    reference_experts_forward,
)

BACKENDS = ("allgather_reducescatter", "all2all", "all2all_fixed")
HIDDEN = 32
INTER = 16
NUM_EXPERTS = 8
# Larger than the 2 experts per rank at 4 ranks: a token can need min(k, S) rows per rank.
TOP_K = 3
WEIGHT_SEED = 0
# Tokens per rank and the ranks whose rows are all padding, per world size and routing.
SCENARIOS = {
    2: {"random": ([11, 0], ()), "skewed": ([13, 5], (1,))},
    4: {"random": ([9, 0, 6, 4], (3,)), "skewed": ([13, 6, 0, 3], (3,))},
}
ROUTES = ("random", "skewed")
# all2all_fixed rows per rank pair unless a test says otherwise: the skewed batches overflow it.
DEFAULT_TEST_CAPACITY = 4
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}
# assert_close's own bf16 tolerances (rtol 1.6e-2, atol 1e-5).
BF16_TOL: dict = {}
RUN_TIMEOUT_S = 60


# ---------------------------------------------------------------- helpers run on every rank


def _expert_weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """All experts' ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``, the same on every rank."""
    gen = torch.Generator().manual_seed(WEIGHT_SEED)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    return w13.to(dtype), w2.to(dtype)


def _batch(world_size: int, route: str, rank: int, dtype: torch.dtype, seed: int = 0):
    """``(hidden [T, H], topk_ids [T, k], topk_weights [T, k])`` of one rank's tokens."""
    counts, all_padding = SCENARIOS[world_size][route]
    num_tokens = counts[rank]
    gen = torch.Generator().manual_seed(1000 * seed + 10 * world_size + rank)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    scores = torch.rand(num_tokens, NUM_EXPERTS, generator=gen)
    if route == "skewed":
        # Nine tokens in ten prefer the last rank's experts.
        per_rank = NUM_EXPERTS // world_size
        hot = torch.rand(num_tokens, generator=gen) < 0.9
        scores[hot, NUM_EXPERTS - per_rank:] += 10.0
    topk_ids = scores.topk(TOP_K, dim=1).indices
    topk_weights = torch.rand(num_tokens, TOP_K, generator=gen)
    pad = torch.zeros(num_tokens, TOP_K, dtype=torch.bool)
    pad[2::5] = True  # whole padding rows
    if num_tokens:
        pad[0, 1] = True  # a single skipped slot
    if rank in all_padding:
        pad[:] = True
    # Padding pairs carry NaN weights, as from garbage logits: they must be masked, not multiplied.
    return hidden, topk_ids.masked_fill(pad, -1), topk_weights.masked_fill(pad, float("nan"))


def _ep_expert_map(rank: int, world_size: int) -> torch.Tensor:
    per_rank = NUM_EXPERTS // world_size
    expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int64)
    expert_map[rank * per_rank:(rank + 1) * per_rank] = torch.arange(per_rank)
    return expert_map


def _reference(batch, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """LocalDispatcher with every expert local, and the plain expert loop."""
    hidden, topk_ids, topk_weights = batch
    local = LocalDispatcher(torch.arange(NUM_EXPERTS))
    handle = local.dispatch_launch(hidden, topk_ids, topk_weights)
    tokens = local.dispatch_wait(handle)
    out = reference_experts_forward(tokens.hidden_states, tokens.expert_ids, w13, w2)
    return local.combine_wait(local.combine_launch(out, handle))


def _check_received(tokens: DispatchedTokens, batches, rank: int, per_rank: int) -> None:
    """Exactly the (token, slot) pairs of all ranks routed to this rank's experts arrived."""
    ids = torch.cat([b[1].reshape(-1) for b in batches])
    weights = torch.cat([b[2].reshape(-1) for b in batches])
    mine = (ids >= 0) & (ids // per_rank == rank)
    valid = tokens.expert_ids >= 0
    assert int(valid.sum()) == int(mine.sum())
    assert torch.equal(
        torch.bincount(tokens.expert_ids[valid], minlength=per_rank),
        torch.bincount(ids[mine] % per_rank, minlength=per_rank),
    )
    assert tokens.hidden_states.shape == (tokens.expert_ids.shape[0], HIDDEN)
    assert tokens.topk_weights.dtype == torch.float32
    assert torch.equal(tokens.topk_weights[~valid], torch.zeros(int((~valid).sum())))
    torch.testing.assert_close(tokens.topk_weights[valid].sum(), weights[mine].sum())


def _make(backend: str, rank: int, world_size: int, group=None, **kwargs) -> MoEDispatcher:
    if backend == "all2all_fixed":
        kwargs.setdefault("capacity", DEFAULT_TEST_CAPACITY)
    return make_dispatcher(backend, _ep_expert_map(rank, world_size), group=group, **kwargs)


def _run_layer(dispatcher, batch, w13_local, w2_local):
    handle = dispatcher.dispatch_launch(*batch)
    tokens = dispatcher.dispatch_wait(handle)
    out = reference_experts_forward(tokens.hidden_states, tokens.expert_ids, w13_local, w2_local)
    return tokens, dispatcher.combine_wait(dispatcher.combine_launch(out, handle))


def _check_backend(
    backend: str, rank: int, world_size: int, dtype: torch.dtype, tol: dict,
    routes=ROUTES, **kwargs,
) -> list[int]:
    """One layer per routing; returns the number of rows received per routing."""
    per_rank = NUM_EXPERTS // world_size
    w13, w2 = _expert_weights(dtype)
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    dispatcher = _make(backend, rank, world_size, **kwargs)
    received = []
    for route in routes:
        batches = [_batch(world_size, route, r, dtype) for r in range(world_size)]
        tokens, out = _run_layer(dispatcher, batches[rank], w13[local], w2[local])
        _check_received(tokens, batches, rank, per_rank)
        expected = _reference(batches[rank], w13, w2)
        assert out.dtype == dtype and out.shape == expected.shape
        torch.testing.assert_close(out, expected, **tol)
        padding_rows = (batches[rank][1] < 0).all(dim=1)
        assert torch.equal(out[padding_rows], torch.zeros_like(out[padding_rows]))
        received.append(tokens.expert_ids.shape[0])
    return received


def _pair_counts(world_size: int, route: str) -> torch.Tensor:
    """``[R, R]`` int64: (token, slot) pairs rank s sends rank d, padding excluded."""
    per_rank = NUM_EXPERTS // world_size
    counts = torch.zeros(world_size, world_size, dtype=torch.int64)
    for src in range(world_size):
        ids = _batch(world_size, route, src, torch.float32)[1].reshape(-1)
        counts[src] = torch.bincount(ids[ids >= 0] // per_rank, minlength=world_size)
    return counts


def _token_rank_units(world_size: int, route: str, rank: int) -> int:
    """(token, rank) pairs of all ranks' batches with at least one slot served by ``rank``."""
    per_rank = NUM_EXPERTS // world_size
    units = 0
    for src in range(world_size):
        ids = _batch(world_size, route, src, torch.float32)[1]
        units += int(((ids >= 0) & (ids // per_rank == rank)).any(dim=1).sum())
    return units


def _expected_rows(world_size: int, route: str, rank: int, capacity: int | None,
                   backend: str = "") -> int:
    """Rows ``rank`` receives: for ``all2all`` k slots per (token, rank) pair sent; every pair
    routed to it (allgather); or ``R * capacity`` fixed rows plus the pairs that did not fit
    (spilled after them)."""
    if backend == "all2all":
        return TOP_K * _token_rank_units(world_size, route, rank)
    into_rank = _pair_counts(world_size, route)[:, rank]
    if capacity is None:
        return int(into_rank.sum())
    return world_size * capacity + int((into_rank - capacity).clamp(min=0).sum())


# ---------------------------------------------------------------- rank functions


def _rank_backend_fp32(rank: int, world_size: int, backend: str) -> list[int]:
    return _check_backend(backend, rank, world_size, torch.float32, FP32_TOL)


def _max_tokens(world_size: int) -> int:
    return max(max(counts) for counts, _ in SCENARIOS[world_size].values())


def _worst_capacity(world_size: int) -> int:
    """Rows one rank can send one destination at most: T_max * min(k, S)."""
    return _max_tokens(world_size) * min(TOP_K, NUM_EXPERTS // world_size)


def _rank_fixed_variants(rank: int, world_size: int) -> dict[str, list[int]]:
    max_tokens, worst = _max_tokens(world_size), _worst_capacity(world_size)
    variants = {
        "static": {"capacity": worst, "max_tokens_per_rank": max_tokens},
        "dynamic_roomy": {"capacity": worst},
        "tiny_1": {"capacity": 1},
        "tiny_2": {"capacity": 2, "max_tokens_per_rank": max_tokens},  # too small: checked
    }
    received = {}
    for name, kwargs in variants.items():
        dispatcher = _make("all2all_fixed", rank, world_size, **kwargs)
        expect_static = name == "static"
        assert dispatcher.overflow_impossible(TOP_K) == expect_static
        # Given the call's agreed counts, the bound is theirs: roomy capacities skip the check.
        assert dispatcher.overflow_impossible(TOP_K, [max_tokens, 1]) == (
            kwargs["capacity"] >= worst)
        # A graph records one shape: only blocks of the whole capacity can be captured.
        assert not dispatcher.capturable([max_tokens, 1], TOP_K)
        full = _make("all2all_fixed", rank, world_size, size_per_step=False, **kwargs)
        assert full.capturable([max_tokens, 1], TOP_K) == (kwargs["capacity"] >= worst)
        received[name] = _check_backend("all2all_fixed", rank, world_size, torch.float32, FP32_TOL, **kwargs)
    if rank == 0:
        # The static promise is checked on the host: a bigger batch is refused.
        dispatcher = _make("all2all_fixed", rank, world_size, capacity=worst, max_tokens_per_rank=1)
        hidden, ids, weights = _batch(world_size, "skewed", 0, torch.float32)
        with pytest.raises(ValueError):
            dispatcher.dispatch_launch(hidden, ids, weights)
    return received


def _rank_bf16(rank: int, world_size: int) -> None:
    for backend in BACKENDS:
        _check_backend(backend, rank, world_size, torch.bfloat16, BF16_TOL)
    _check_backend("all2all_fixed", rank, world_size, torch.bfloat16, BF16_TOL, capacity=1)


def _rank_interleaved(rank: int, world_size: int) -> None:
    """Two micro-batches with interleaved launches and waits, on two EP subgroups of 2 ranks
    (group ranks differ from global ranks in the second)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    ep_rank, ep_size = dist.get_rank(group), dist.get_world_size(group)
    per_rank = NUM_EXPERTS // ep_size
    w13, w2 = _expert_weights(torch.float32)
    local = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    for backend in BACKENDS:
        for kwargs in ({"capacity": 1}, {"capacity": 64}) if backend == "all2all_fixed" else ({},):
            dispatcher = _make(backend, ep_rank, ep_size, group=group, **kwargs)
            assert (dispatcher.ep_rank, dispatcher.ep_size) == (ep_rank, ep_size)
            batches = [_batch(ep_size, route, ep_rank, torch.float32, seed=rank // 2)
                       for route in ROUTES]
            handles = [dispatcher.dispatch_launch(*b) for b in batches]
            tokens = [dispatcher.dispatch_wait(h) for h in handles]
            outs = [reference_experts_forward(t.hidden_states, t.expert_ids, w13[local], w2[local])
                    for t in tokens]
            combines = [dispatcher.combine_launch(o, h) for o, h in zip(outs, handles)]
            results = [dispatcher.combine_wait(c) for c in reversed(combines)][::-1]
            for batch, result in zip(batches, results):
                torch.testing.assert_close(result, _reference(batch, w13, w2), **FP32_TOL)


def _rank_bad_maps(rank: int, world_size: int) -> None:
    good = _ep_expert_map(rank, world_size)
    swapped = good.clone()
    block = slice(rank * 4, rank * 4 + 2)
    swapped[block] = swapped[block].flip(0)  # local ids 1, 0, 2, 3: a permutation, wrong order
    other_rank = _ep_expert_map(1 - rank, world_size)  # the other rank's block
    bad_maps = {
        "all_local": torch.arange(NUM_EXPERTS),
        "swapped": swapped,
        "other_rank": other_rank,
        "not_divisible": torch.tensor([0, 1, 2, -1, -1, -1, -1] if rank == 0 else [-1, -1, -1, -1, 0, 1, 2]),
        "int32": good.to(torch.int32),
        "empty": torch.empty(0, dtype=torch.int64),
    }
    for backend in BACKENDS:
        extra = {"capacity": 4} if backend == "all2all_fixed" else {}
        make_dispatcher(backend, good, group=None, **extra)
        for name, bad in bad_maps.items():
            with pytest.raises(ValueError):
                make_dispatcher(backend, bad, group=None, **extra)
                raise AssertionError(f"{backend} accepted the {name} expert map")
    with pytest.raises(ValueError):
        FixedCapacityAll2AllDispatcher(good, group=None, capacity=0)
    with pytest.raises(ValueError):
        FixedCapacityAll2AllDispatcher(good, group=None, capacity=4, max_tokens_per_rank=-1)


# ---------------------------------------------------------------- tests


def test_registry_names():
    from widellm.layers.moe import DISPATCHER_REGISTRY

    assert DISPATCHER_REGISTRY["allgather_reducescatter"] is AllGatherDispatcher
    assert DISPATCHER_REGISTRY["all2all"] is All2AllDispatcher
    assert DISPATCHER_REGISTRY["all2all_fixed"] is FixedCapacityAll2AllDispatcher


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_local_fp32(backend, world_size):
    received = run_ranks(_rank_backend_fp32, world_size, backend, timeout_s=RUN_TIMEOUT_S)
    capacity = DEFAULT_TEST_CAPACITY if backend == "all2all_fixed" else None
    for rank, per_route in enumerate(received):
        assert per_route == [_expected_rows(world_size, route, rank, capacity, backend)
                             for route in ROUTES]


@pytest.mark.parametrize("world_size", [2, 4])
def test_fixed_capacity_static_and_overflow(world_size):
    received = run_ranks(_rank_fixed_variants, world_size, timeout_s=RUN_TIMEOUT_S)
    worst = _worst_capacity(world_size)
    for rank, by_variant in enumerate(received):
        for name, capacity in (("static", worst), ("dynamic_roomy", worst), ("tiny_1", 1), ("tiny_2", 2)):
            assert by_variant[name] == [
                _expected_rows(world_size, route, rank, capacity) for route in ROUTES
            ], name
    # The skewed batch overflows a capacity of 1 or 2 on the hot rank: the spill path ran.
    hot = world_size - 1
    assert received[hot]["tiny_1"][1] > world_size * 1
    assert received[hot]["tiny_2"][1] > world_size * 2
    # The worst case fits every batch, so nothing spills.
    assert all(r["static"] == [world_size * worst] * 2 for r in received)


def test_bf16_all_backends():
    run_ranks(_rank_bf16, 2, timeout_s=RUN_TIMEOUT_S)


def test_interleaved_micro_batches_on_subgroups():
    run_ranks(_rank_interleaved, 4, timeout_s=RUN_TIMEOUT_S)


def test_bad_expert_map_raises():
    run_ranks(_rank_bad_maps, 2, timeout_s=RUN_TIMEOUT_S)


# ---------------------------------------------------------------- the run_ranks helper


def _rank_sum(rank: int, world_size: int, scale: float) -> float:
    x = torch.tensor([rank * scale])
    dist.all_reduce(x)
    return float(x)


def _rank_fail_or_hang(rank: int, world_size: int, pid_dir: str, fail: bool) -> None:
    # Written aside and renamed: a rank killed mid-write (rank 1 fails at once) leaves no
    # empty file behind for _assert_gone to read.
    path = os.path.join(pid_dir, str(rank))
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    if rank == 1 and fail:
        raise KeyError("boom")
    time.sleep(600)


def _assert_gone(pid_dir: str) -> None:
    pids = [int(open(os.path.join(pid_dir, name)).read()) for name in os.listdir(pid_dir)
            if not name.endswith(".tmp")]
    assert pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_run_ranks_results_in_rank_order():
    assert run_ranks(_rank_sum, 3, 0.5, timeout_s=RUN_TIMEOUT_S) == [1.5, 1.5, 1.5]


def test_run_ranks_reports_rank_error_and_stops_all(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 failed.*KeyError: 'boom'"):
        run_ranks(_rank_fail_or_hang, 2, str(tmp_path), True, timeout_s=RUN_TIMEOUT_S)
    assert time.monotonic() - start < RUN_TIMEOUT_S / 2  # at once, not at the timeout
    _assert_gone(str(tmp_path))


def test_run_ranks_times_out_and_stops_all(tmp_path):
    run_ranks(_rank_sum, 2, 1.0, timeout_s=RUN_TIMEOUT_S)  # forkserver up: ranks start at once
    with pytest.raises(TimeoutError):
        run_ranks(_rank_fail_or_hang, 2, str(tmp_path), False, timeout_s=3)
    _assert_gone(str(tmp_path))
