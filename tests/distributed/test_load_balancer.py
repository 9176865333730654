"""DPLoadBalancer: load spreading, stats corrections, prefix affinity and its bounds."""

from __future__ import annotations

import pytest

from widellm.core.kv_cache_manager import KVCacheManager
from widellm.core.request import Request
from widellm.distributed.load_balancer import DPLoadBalancer
from widellm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _prompt(seed: int, num_tokens: int) -> list[int]:
    """Tokens no other seed shares, so distinct seeds share no block."""
    return [seed * 10_000 + i for i in range(num_tokens)]


def _lb(num_ranks: int = 2, **kwargs) -> DPLoadBalancer:
    kwargs.setdefault("max_tracked_blocks", 1024)
    kwargs.setdefault("min_prefix_blocks", 4)
    return DPLoadBalancer(num_ranks, BLOCK_SIZE, **kwargs)


# ---- load ------------------------------------------------------------------------------------


def test_burst_onto_idle_ranks_spreads_evenly():
    lb = _lb(4)
    ranks = [lb.choose_rank(_prompt(seed, 40)) for seed in range(8)]
    assert ranks == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [lb.num_in_flight(r) for r in range(4)] == [2, 2, 2, 2]
    assert [lb.load(r) for r in range(4)] == [8, 8, 8, 8]  # 2 waiting x weight 4


def test_sequential_requests_on_idle_ranks_round_robin():
    lb = _lb(3)
    ranks = []
    for seed in range(4):
        rank = lb.choose_rank(_prompt(seed, 8))
        ranks.append(rank)
        lb.request_finished(rank)
        lb.update_stats(rank, num_waiting=0, num_running=0)
    assert ranks == [0, 1, 2, 0]


def test_rank_reporting_many_waiting_is_avoided():
    lb = _lb(4)
    lb.update_stats(1, num_waiting=10, num_running=0)
    assert lb.load(1) == 40
    ranks = [lb.choose_rank(_prompt(seed, 8)) for seed in range(6)]
    assert ranks == [0, 2, 3, 0, 2, 3]


def test_stats_replace_the_estimate():
    lb = _lb(2)
    assert [lb.choose_rank(_prompt(s, 8)) for s in range(2)] == [0, 1]
    assert lb.load(0) == 4  # sent since the last report: counted as waiting
    lb.update_stats(0, num_waiting=0, num_running=1)  # it got scheduled
    assert lb.load(0) == 1
    assert lb.num_in_flight(0) == 1  # stats do not change what the frontend has in flight
    assert lb.choose_rank(_prompt(2, 8)) == 0  # load 1 < 4


def test_waiting_weighs_more_than_running():
    lb = _lb(2)
    lb.update_stats(0, num_waiting=0, num_running=3)
    lb.update_stats(1, num_waiting=1, num_running=0)
    assert (lb.load(0), lb.load(1)) == (3, 4)
    assert lb.choose_rank(_prompt(0, 8)) == 0


def test_request_finished_reduces_load():
    lb = _lb(2)
    assert [lb.choose_rank(_prompt(s, 8)) for s in range(4)] == [0, 1, 0, 1]
    lb.update_stats(0, num_waiting=0, num_running=2)
    assert lb.load(0) == 2
    lb.request_finished(0)  # comes off running
    assert (lb.load(0), lb.num_in_flight(0)) == (1, 1)
    assert lb.load(1) == 8
    lb.request_finished(1)  # none reported running: comes off the waiting estimate
    assert (lb.load(1), lb.num_in_flight(1)) == (4, 1)
    lb.request_finished(1)
    assert (lb.load(1), lb.num_in_flight(1)) == (0, 0)
    assert lb.choose_rank(_prompt(9, 8)) == 1  # now the least loaded (0 < 1)
    lb.request_finished(0)
    lb.request_finished(1)
    with pytest.raises(ValueError, match="no request in flight"):
        lb.request_finished(1)


# ---- prefix affinity -------------------------------------------------------------------------


def _lb_with_prefix_on_rank0(**kwargs):
    """Rank 0 got an 8-block prompt, rank 1 an unrelated one; both reports then idle."""
    lb = _lb(2, **kwargs)
    base = _prompt(1, 8 * BLOCK_SIZE)
    assert lb.choose_rank(base) == 0
    assert lb.choose_rank(_prompt(2, 8 * BLOCK_SIZE)) == 1
    return lb, base


def test_long_shared_prefix_attracts_despite_slightly_higher_load():
    lb, base = _lb_with_prefix_on_rank0()
    lb.update_stats(0, num_waiting=0, num_running=2)
    lb.update_stats(1, num_waiting=0, num_running=1)
    prompt = base + _prompt(3, 10)
    assert lb.prefix_match_blocks(prompt) == [8, 0]
    assert lb.choose_rank(prompt) == 0  # credit 8 x 0.5 = 4: 2 - 4 < 1


# ---- keys shared with the engine -------------------------------------------------------------


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_balancer_and_block_pool_agree_on_keys(salt):
    prompt = _prompt(5, 6 * BLOCK_SIZE + 3)  # 6 full blocks and a partial one
    request = Request("r", prompt, SamplingParams(), eos_token_ids=frozenset(), max_tokens=4,
                      cache_salt=salt)
    manager = KVCacheManager(16, BLOCK_SIZE, enable_caching=True)
    hits, _ = manager.get_computed_blocks(request)
    manager.allocate_slots(request, request.num_tokens, hits)
    pool_keys = [blk.block_hash for blk in manager.req_to_blocks["r"][:6]]

    keys = _lb(2).block_hashes(prompt, salt)
    assert len(keys) == 6
    assert keys == request.block_hashes == pool_keys
    assert all(isinstance(k, bytes) and len(k) == 32 for k in keys)


def test_salted_prompts_match_only_their_own_salt():
    lb, base = _lb_with_prefix_on_rank0()  # base on rank 0 without a salt
    prompt = base + _prompt(3, 10)
    assert lb.prefix_match_blocks(prompt) == [8, 0]
    assert lb.prefix_match_blocks(prompt, "tenant-a") == [0, 0]

    lb.update_stats(0, num_waiting=0, num_running=0)
    lb.update_stats(1, num_waiting=0, num_running=0)
    assert lb.choose_rank(base, "tenant-a") == 0  # round robin: no credit anywhere
    assert lb.prefix_match_blocks(prompt, "tenant-a") == [8, 0]
    assert lb.prefix_match_blocks(prompt, "tenant-b") == [0, 0]
    lb.assign(1, base, "tenant-b")
    assert lb.prefix_match_blocks(prompt, "tenant-b") == [0, 8]
    assert lb.prefix_match_blocks(prompt) == [8, 0]


def test_long_shared_prefix_ignored_when_rank_much_more_loaded():
    lb, base = _lb_with_prefix_on_rank0()
    lb.update_stats(0, num_waiting=5, num_running=0)
    lb.update_stats(1, num_waiting=0, num_running=1)
    assert lb.choose_rank(base + _prompt(3, 10)) == 1  # 20 - 4 > 1


def test_slack_boundary_is_inclusive():
    lb, base = _lb_with_prefix_on_rank0()
    lb.update_stats(0, num_waiting=0, num_running=5)  # exactly slack 4 above rank 1
    lb.update_stats(1, num_waiting=0, num_running=1)
    assert lb.choose_rank(base + _prompt(3, 10)) == 0
    lb.update_stats(0, num_waiting=0, num_running=6)  # one above the slack
    lb.update_stats(1, num_waiting=0, num_running=1)
    assert lb.choose_rank(base + _prompt(4, 10)) == 1


@pytest.mark.parametrize(
    ("num_shared_blocks", "rank0_running", "expected_rank"),
    [
        (16, 9, 0),  # credit 16 x 0.5 = 8: rank 0 may be up to 8 busier
        (16, 10, 1),
        (40, 11, 0),  # credit 40 x 0.5 = 20, capped at 10
        (40, 12, 1),
    ],
)
def test_slack_grows_with_prefix_length_up_to_the_cap(
    num_shared_blocks, rank0_running, expected_rank
):
    lb = _lb(2, max_prefix_slack=10.0)
    base = _prompt(1, 40 * BLOCK_SIZE)
    assert lb.choose_rank(base) == 0
    lb.update_stats(0, num_waiting=0, num_running=rank0_running)
    lb.update_stats(1, num_waiting=0, num_running=1)
    prompt = base[:num_shared_blocks * BLOCK_SIZE] + _prompt(2, 3)
    assert lb.choose_rank(prompt) == expected_rank


def test_short_shared_prefix_is_ignored():
    lb, base = _lb_with_prefix_on_rank0()
    lb.update_stats(0, num_waiting=0, num_running=2)
    lb.update_stats(1, num_waiting=0, num_running=1)
    prompt = base[:3 * BLOCK_SIZE] + _prompt(3, 20)
    assert lb.prefix_match_blocks(prompt) == [3, 0]  # < min_prefix_blocks = 4
    assert lb.choose_rank(prompt) == 1


def test_partial_last_blocks_do_not_count():
    lb, base = _lb_with_prefix_on_rank0()
    lb.update_stats(0, num_waiting=0, num_running=2)
    lb.update_stats(1, num_waiting=0, num_running=1)
    # Shares 3 blocks and 3 tokens of the 4th: only 3 blocks match.
    prompt = base[:4 * BLOCK_SIZE - 1] + _prompt(3, 20)
    assert lb.prefix_match_blocks(prompt) == [3, 0]
    assert lb.choose_rank(prompt) == 1

    # A 15-token prompt records 3 blocks; its trailing 3 tokens are no block.
    lb = _lb(2)
    short = _prompt(4, 4 * BLOCK_SIZE - 1)
    assert lb.choose_rank(short) == 0
    assert lb.num_tracked_blocks(0) == 3
    lb.update_stats(0, num_waiting=0, num_running=2)
    lb.update_stats(1, num_waiting=0, num_running=1)
    extended = short + [short[-1] + 1]  # the 4th block is full now, but rank 0 never saw it
    assert lb.prefix_match_blocks(extended) == [3, 0]
    assert lb.choose_rank(extended) == 1


def test_longest_match_wins_among_ranks_holding_the_prefix():
    lb = _lb(3)
    base = _prompt(1, 12 * BLOCK_SIZE)
    assert lb.choose_rank(base[:6 * BLOCK_SIZE]) == 0
    assert lb.choose_rank(base) == 1  # rank 0: 4 - 3 > 0 of idle rank 1
    for rank in range(3):
        lb.update_stats(rank, num_waiting=0, num_running=1)
    prompt = base + _prompt(2, 5)
    assert lb.prefix_match_blocks(prompt) == [6, 12, 0]
    assert lb.choose_rank(prompt) == 1  # 1 - 6 < 1 - 3 < 1
    # Equal load - credit (4 - 6 = 1 - 3): the longer match wins the tie.
    lb.update_stats(0, num_waiting=0, num_running=1)
    lb.update_stats(1, num_waiting=0, num_running=4)
    assert lb.choose_rank(base + _prompt(3, 5)) == 1


# ---- LRU bound -------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_new_blocks", "expected_rank"), [(8, 0), (17, 1)])
def test_lru_bound_forgets_the_oldest_prefix(num_new_blocks, expected_rank):
    lb = _lb(2, max_tracked_blocks=16)
    base = _prompt(1, 8 * BLOCK_SIZE)
    assert lb.choose_rank(base) == 0
    # Rank 0 receives num_new_blocks unrelated blocks while rank 1 is busy.
    lb.update_stats(0, num_waiting=0, num_running=0)
    lb.update_stats(1, num_waiting=1, num_running=0)
    assert lb.choose_rank(_prompt(2, num_new_blocks * BLOCK_SIZE)) == 0
    assert lb.num_tracked_blocks(0) == 16
    lb.update_stats(0, num_waiting=0, num_running=1)
    lb.update_stats(1, num_waiting=0, num_running=0)
    prompt = base + _prompt(3, 5)
    assert lb.prefix_match_blocks(prompt) == [8 if num_new_blocks == 8 else 0, 0]
    assert lb.choose_rank(prompt) == expected_rank


def test_lru_evicts_deepest_blocks_first_and_sending_refreshes():
    lb = _lb(2, max_tracked_blocks=16)
    base = _prompt(1, 8 * BLOCK_SIZE)
    other = _prompt(2, 8 * BLOCK_SIZE)
    assert lb.choose_rank(base) == 0
    lb.update_stats(0, num_waiting=0, num_running=0)
    lb.update_stats(1, num_waiting=1, num_running=0)
    assert lb.choose_rank(other) == 0
    lb.update_stats(0, num_waiting=0, num_running=0)
    assert lb.choose_rank(base) == 0  # sending base again makes it the most recent
    lb.update_stats(0, num_waiting=0, num_running=0)
    assert lb.choose_rank(_prompt(3, 2 * BLOCK_SIZE)) == 0  # evicts 2 blocks of `other`
    assert lb.prefix_match_blocks(base) == [8, 0]
    assert lb.prefix_match_blocks(other) == [6, 0]  # its root survives, its tail went


# ---- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_ranks": 0}, "num_ranks"),
        ({"num_ranks": True}, "num_ranks"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 2.5}, "block_size"),
        ({"max_tracked_blocks": 0}, "max_tracked_blocks"),
        ({"min_prefix_blocks": 0}, "min_prefix_blocks"),
        ({"prefix_slack_per_block": -0.5}, "prefix_slack_per_block"),
        ({"max_prefix_slack": -1.0}, "max_prefix_slack"),
        ({"max_prefix_slack": float("nan")}, "max_prefix_slack"),
        ({"waiting_weight": 0.0}, "waiting_weight"),
        ({"running_weight": -1.0}, "running_weight"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs, name):
    args = {"num_ranks": 2, "block_size": BLOCK_SIZE, "max_tracked_blocks": 16} | kwargs
    with pytest.raises(ValueError, match=name):
        DPLoadBalancer(args.pop("num_ranks"), args.pop("block_size"), **args)


def test_bad_call_arguments_raise():
    lb = _lb(2)
    with pytest.raises(ValueError, match="rank"):
        lb.load(2)
    with pytest.raises(ValueError, match="rank"):
        lb.update_stats(-1, num_waiting=0, num_running=0)
    with pytest.raises(ValueError, match="num_waiting"):
        lb.update_stats(0, num_waiting=-1, num_running=0)
    with pytest.raises(ValueError, match="num_running"):
        lb.update_stats(0, num_waiting=0, num_running=-1)
    with pytest.raises(ValueError, match="no request in flight"):
        lb.request_finished(0)
