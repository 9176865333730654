"""KVCacheManager: chained block hashes, prefix-cache lookups, allocation and freeing."""

from tests.core.old_hash_collision import (
    COLLIDING_BLOCK_A, COLLIDING_BLOCK_B, COLLIDING_BLOCK_SIZE, old_chain_block_hashes,
)
from widellm.core import block_hash, kv_cache_manager
from widellm.core.block_hash import ROOT_BLOCK_HASH, hash_block_tokens
from widellm.core.kv_cache_manager import KVCacheManager
from widellm.core.request import Request
from widellm.sampling_params import SamplingParams

# Small blocks keep the prompts short enough to check by hand.
BLOCK_SIZE = 4
EOS = 2
MAX_TOKENS = 8


def make_request(req_id: str, prompt: list[int], cache_salt: str | None = None,
                 **params) -> Request:
    return Request(
        req_id, prompt, SamplingParams(**params), eos_token_ids=frozenset({EOS}),
        max_tokens=MAX_TOKENS, cache_salt=cache_salt,
    )


def make_manager(num_blocks: int, enable_caching: bool = True,
                 block_size: int = BLOCK_SIZE) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, enable_caching)


def admit(manager: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a waiting request: look up hits, allocate the rest."""
    hits, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new is not None
    manager.record_prefix_cache_stats(request.num_tokens, num_hit)
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.request_id)


# ---- hashes ----------------------------------------------------------------------------------


def test_block_hashes_chain_over_full_blocks_only():
    manager = make_manager(8)
    tokens = list(range(10, 20))  # 2 full blocks + 2 tokens
    req = make_request("r", tokens)

    manager.update_block_hashes(req)

    first = hash_block_tokens(ROOT_BLOCK_HASH, tokens[0:4])
    second = hash_block_tokens(first, tokens[4:8])
    assert req.block_hashes == [first, second]

    req.append_output_token(20)
    req.append_output_token(21)  # block 2 is now full: 18, 19, 20, 21
    manager.update_block_hashes(req)
    assert req.block_hashes == [first, second, hash_block_tokens(second, [18, 19, 20, 21])]


def test_equal_prefixes_give_equal_hashes_until_they_differ():
    manager = make_manager(8)
    a = make_request("a", [1, 1, 1, 1, 5, 5, 5, 5, 7, 7, 7, 7])
    b = make_request("b", [1, 1, 1, 1, 5, 5, 5, 5, 8, 8, 8, 8])
    manager.update_block_hashes(a)
    manager.update_block_hashes(b)

    assert a.block_hashes[:2] == b.block_hashes[:2]
    assert a.block_hashes[2] != b.block_hashes[2]


def test_a_different_first_block_changes_every_later_hash():
    manager = make_manager(8)
    shared_tail = [5, 5, 5, 5, 6, 6, 6, 6]
    a = make_request("a", [1, 1, 1, 1] + shared_tail)
    b = make_request("b", [9, 9, 9, 9] + shared_tail)
    manager.update_block_hashes(a)
    manager.update_block_hashes(b)

    assert len(a.block_hashes) == len(b.block_hashes) == 3
    assert all(ha != hb for ha, hb in zip(a.block_hashes, b.block_hashes))


# ---- prefix-cache lookups --------------------------------------------------------------------


def test_hits_never_cover_the_last_prompt_token():
    manager = make_manager(8)
    prompt = [3, 3, 3, 3, 4, 4, 4, 4]  # exactly 2 full blocks
    assert admit(manager, make_request("a", prompt)) == [0, 1]

    # The same prompt may reuse only block 0: its last token must run to produce logits.
    hits, num_hit = manager.get_computed_blocks(make_request("b", prompt))
    assert [b.block_id for b in hits] == [0]
    assert num_hit == BLOCK_SIZE

    # One more token and both blocks are usable.
    hits, num_hit = manager.get_computed_blocks(make_request("c", prompt + [5]))
    assert [b.block_id for b in hits] == [0, 1]
    assert num_hit == 2 * BLOCK_SIZE


def test_hit_run_stops_at_the_first_miss():
    manager = make_manager(8)
    admit(manager, make_request("a", [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]))

    # Block 1 differs, so block 2 (same tokens, different parent) is a miss as well.
    hits, num_hit = manager.get_computed_blocks(
        make_request("b", [1, 1, 1, 1, 9, 9, 9, 9, 3, 3, 3, 3, 4])
    )
    assert [b.block_id for b in hits] == [0]
    assert num_hit == BLOCK_SIZE


def test_prefix_cache_counters_are_in_tokens():
    manager = make_manager(8)
    prompt = [3, 3, 3, 3, 4, 4, 4, 4, 5]  # 9 tokens
    admit(manager, make_request("a", prompt))  # cold: 9 queried, 0 hit
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (9, 0)

    admit(manager, make_request("b", prompt))  # 9 queried, 8 hit
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (18, 8)

    # A lookup whose allocation fails (the request keeps waiting) is not counted.
    manager.get_computed_blocks(make_request("c", prompt))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (18, 8)


def test_requests_with_prompt_logprobs_skip_the_cache():
    manager = make_manager(8)
    prompt = [3, 3, 3, 3, 4, 4, 4, 4, 5]
    admit(manager, make_request("a", prompt))
    queries, hits = manager.prefix_cache_queries, manager.prefix_cache_hits

    # Logprobs are needed for every prompt position, so nothing may be skipped.
    result = manager.get_computed_blocks(make_request("b", prompt, prompt_logprobs=1))

    assert result == ([], 0)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (queries, hits)


def test_no_hits_and_no_hashes_registered_without_caching():
    manager = make_manager(8, enable_caching=False)
    prompt = [3, 3, 3, 3, 4, 4, 4, 4, 5]
    admit(manager, make_request("a", prompt))

    assert manager.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    assert manager.block_pool.cached_blocks == {}


# ---- allocation ------------------------------------------------------------------------------


def test_allocation_in_chunks_returns_only_new_blocks_and_caches_full_ones():
    manager = make_manager(8)
    req = make_request("r", list(range(100, 110)))  # 10 tokens -> 3 blocks
    manager.update_block_hashes(req)

    first = manager.allocate_slots(req, 6)  # tokens 0..5: block 0 full, block 1 partial
    req.num_computed_tokens = 6
    assert [b.block_id for b in first] == [0, 1]
    assert manager.block_pool.cached_blocks == {req.block_hashes[0]: first[0]}

    second = manager.allocate_slots(req, 4)  # tokens 6..9: block 1 full, block 2 partial
    req.num_computed_tokens = 10
    assert [b.block_id for b in second] == [2]
    assert manager.get_block_ids("r") == [0, 1, 2]
    blocks = manager.req_to_blocks["r"]
    assert manager.block_pool.cached_blocks == {
        req.block_hashes[0]: blocks[0], req.block_hashes[1]: blocks[1],
    }

    # Room left in block 2 (10 of 12 slots used): no new block for the next token.
    req.append_output_token(110)
    assert manager.allocate_slots(req, 1) == []


def test_hits_are_shared_and_reference_counted():
    manager = make_manager(8)
    prompt = [3, 3, 3, 3, 4, 4, 4, 4, 5]
    a, b = make_request("a", prompt), make_request("b", prompt)
    assert admit(manager, a) == [0, 1, 2]
    assert admit(manager, b) == [0, 1, 3]

    pool = manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert manager.num_free_blocks == 4


def test_allocate_slots_returns_none_and_changes_nothing_when_short():
    manager = make_manager(3)
    running = make_request("running", [1] * 8)  # 2 blocks
    assert admit(manager, running) == [0, 1]

    late = make_request("late", [9] * 8)  # needs 2 blocks, 1 free
    assert manager.allocate_slots(late, 8) is None

    assert manager.num_free_blocks == 1
    assert manager.block_pool.free_block_queue.block_ids() == [2]
    assert "late" not in manager.req_to_blocks
    assert manager.get_block_ids("running") == [0, 1]


def test_allocate_slots_for_a_running_request_keeps_its_blocks_when_short():
    manager = make_manager(2)
    req = make_request("r", [1] * 8)  # fills both blocks
    assert admit(manager, req) == [0, 1]
    req.append_output_token(7)

    assert manager.allocate_slots(req, 1) is None

    assert manager.get_block_ids("r") == [0, 1]
    assert [b.ref_cnt for b in manager.block_pool.blocks] == [1, 1]


def test_revived_hits_count_against_the_free_blocks():
    manager = make_manager(4)
    pool = manager.block_pool
    prompt = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    first = make_request("first", prompt + [4])  # 13 tokens -> blocks 0, 1, 2, 3
    assert admit(manager, first) == [0, 1, 2, 3]
    manager.free(first)
    assert pool.free_block_queue.block_ids() == [3, 2, 1, 0]

    # 3 hits (blocks 0-2, all free) + 2 new blocks for 20 tokens: the pool has 4 free blocks,
    # but reviving the hits leaves only 1 allocatable.
    greedy = make_request("greedy", prompt + [5] * 8)
    hits, num_hit = manager.get_computed_blocks(greedy)
    assert [b.block_id for b in hits] == [0, 1, 2] and num_hit == 12
    assert manager.allocate_slots(greedy, greedy.num_tokens - num_hit, hits) is None

    assert pool.free_block_queue.block_ids() == [3, 2, 1, 0]
    assert [b.ref_cnt for b in pool.blocks] == [0, 0, 0, 0]
    assert "greedy" not in manager.req_to_blocks
    assert len(pool.cached_blocks) == 3

    # 16 tokens need just 1 new block besides the 3 hits: that fits exactly.
    modest = make_request("modest", prompt + [5] * 4)
    hits, num_hit = manager.get_computed_blocks(modest)
    new = manager.allocate_slots(modest, modest.num_tokens - num_hit, hits)
    assert [b.block_id for b in new] == [3]
    assert manager.get_block_ids("modest") == [0, 1, 2, 3]
    assert manager.num_free_blocks == 0


def test_free_returns_every_block_tail_first():
    manager = make_manager(6)
    a = make_request("a", [1] * 9)  # 3 blocks
    b = make_request("b", [1] * 9)  # shares 2 blocks with a, 1 of its own
    assert admit(manager, a) == [0, 1, 2]
    assert admit(manager, b) == [0, 1, 3]

    manager.free(a)
    # Blocks 0 and 1 are still held by b; only a's private tail is free.
    assert manager.block_pool.free_block_queue.block_ids() == [4, 5, 2]

    manager.free(b)
    assert manager.num_free_blocks == 6
    assert manager.block_pool.free_block_queue.block_ids() == [4, 5, 2, 3, 1, 0]
    assert manager.req_to_blocks == {} and manager.num_cached_blocks == {}


def test_reset_prefix_cache_only_when_idle():
    manager = make_manager(4)
    req = make_request("r", [1] * 9)
    admit(manager, req)
    assert manager.reset_prefix_cache() is False

    manager.free(req)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("again", [1] * 9)) == ([], 0)


# ---- collisions and the token check ----------------------------------------------------------


def test_blocks_colliding_under_the_old_scheme_are_never_shared():
    bs = COLLIDING_BLOCK_SIZE
    manager = make_manager(8, block_size=bs)
    a = make_request("a", COLLIDING_BLOCK_A + [7])
    b = make_request("b", COLLIDING_BLOCK_B + [7])
    manager.update_block_hashes(a)
    manager.update_block_hashes(b)
    # The old keys of the two first blocks are equal; the new ones are not.
    assert (old_chain_block_hashes(a.all_token_ids, bs)
            == old_chain_block_hashes(b.all_token_ids, bs))
    assert a.block_hashes != b.block_hashes

    assert admit(manager, a) == [0, 1]
    assert manager.get_computed_blocks(b) == ([], 0)
    assert admit(manager, b) == [2, 3]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (34, 0)
    assert [blk.ref_cnt for blk in manager.block_pool.blocks[:4]] == [1, 1, 1, 1]


def test_the_token_check_refuses_the_old_schemes_collision(monkeypatch):
    # Put the old keys back: b's first key now finds a's block, whose tokens differ.
    monkeypatch.setattr(kv_cache_manager, "chain_block_hashes", old_chain_block_hashes)
    bs = COLLIDING_BLOCK_SIZE
    manager = make_manager(8, block_size=bs)
    a = make_request("a", COLLIDING_BLOCK_A + [7])
    b = make_request("b", COLLIDING_BLOCK_B + [7])
    assert admit(manager, a) == [0, 1]
    manager.update_block_hashes(b)
    assert b.block_hashes[0] in manager.block_pool.cached_blocks

    assert manager.get_computed_blocks(b) == ([], 0)
    assert admit(manager, b) == [2, 3]
    # The same prompt as a still hits its block: the check refuses only other contents.
    hits, num_hit = manager.get_computed_blocks(make_request("a2", COLLIDING_BLOCK_A + [7]))
    assert [blk.block_id for blk in hits] == [0] and num_hit == bs


def test_the_token_check_refuses_a_forced_key_clash(monkeypatch):
    # Every block of every request gets one key.
    monkeypatch.setattr(block_hash, "_digest", lambda data: b"\x00" * 32)
    manager = make_manager(8)
    a = make_request("a", [1, 1, 1, 1, 2, 2, 2, 2, 9])
    assert admit(manager, a) == [0, 1, 2]
    assert a.block_hashes == [b"\x00" * 32] * 2
    # The first block wins the key; block 1 stays private.
    assert manager.block_pool.cached_blocks == {b"\x00" * 32: manager.block_pool.blocks[0]}

    other = make_request("other", [3, 3, 3, 3, 2, 2, 2, 2, 9])
    assert manager.get_computed_blocks(other) == ([], 0)
    assert admit(manager, other) == [3, 4, 5]

    # The same prompt hits block 0; its block 1 finds block 0 under the same key and misses.
    hits, num_hit = manager.get_computed_blocks(make_request("again", a.prompt_token_ids))
    assert [blk.block_id for blk in hits] == [0] and num_hit == BLOCK_SIZE
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (18, 0)


# ---- cache_salt ------------------------------------------------------------------------------


def test_cache_salt_shares_within_a_salt_and_never_across():
    manager = make_manager(16)
    prompt = [3, 3, 3, 3, 4, 4, 4, 4, 5]  # 2 full blocks, 8 tokens a hit can cover
    assert admit(manager, make_request("a1", prompt, cache_salt="tenant-a")) == [0, 1, 2]
    assert admit(manager, make_request("a2", prompt, cache_salt="tenant-a")) == [0, 1, 3]
    assert manager.prefix_cache_hits == 8

    assert admit(manager, make_request("b1", prompt, cache_salt="tenant-b")) == [4, 5, 6]
    assert manager.prefix_cache_hits == 8
    assert admit(manager, make_request("none1", prompt)) == [7, 8, 9]
    assert manager.prefix_cache_hits == 8
    assert admit(manager, make_request("none2", prompt)) == [7, 8, 10]
    assert admit(manager, make_request("b2", prompt, cache_salt="tenant-b")) == [4, 5, 11]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (54, 24)


def test_the_salt_stays_in_the_keys_of_blocks_filled_by_decoding():
    manager = make_manager(8)
    salted = make_request("s", [1, 1, 1, 1, 2, 2], cache_salt="x")
    plain = make_request("p", [1, 1, 1, 1, 2, 2])
    for req in (salted, plain):
        manager.update_block_hashes(req)
        req.append_output_token(3)
        req.append_output_token(3)
        manager.update_block_hashes(req)
    assert len(salted.block_hashes) == len(plain.block_hashes) == 2
    assert salted.block_hashes[1] == hash_block_tokens(salted.block_hashes[0], [2, 2, 3, 3])
    assert all(s != p for s, p in zip(salted.block_hashes, plain.block_hashes))
