"""BlockPool and FreeBlockQueue: eviction order, revival, hashes and reference counts."""

import pytest

from widellm.core.block_hash import ROOT_BLOCK_HASH, hash_block_tokens
from widellm.core.block_pool import BlockPool

# Distinct blocks' contents and their prefix-cache keys; the pool treats keys as opaque.
TOKENS_A = (1, 2, 3, 4)
TOKENS_B = (5, 6, 7, 8)
TOKENS_C = (9, 10, 11, 12)
HASH_A = hash_block_tokens(ROOT_BLOCK_HASH, TOKENS_A)
HASH_B = hash_block_tokens(ROOT_BLOCK_HASH, TOKENS_B)
HASH_C = hash_block_tokens(ROOT_BLOCK_HASH, TOKENS_C)


def test_new_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(4, enable_caching=True)
    assert pool.free_block_queue.block_ids() == [0, 1, 2, 3]

    blocks = pool.get_new_blocks(2)

    assert [b.block_id for b in blocks] == [0, 1]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.free_block_queue.block_ids() == [2, 3]
    assert pool.num_free_blocks == 2


def test_popleft_takes_least_recently_freed_block():
    pool = BlockPool(3, enable_caching=True)
    b0, b1, b2 = pool.get_new_blocks(3)
    pool.free_blocks([b1])
    pool.free_blocks([b2])
    pool.free_blocks([b0])
    assert pool.free_block_queue.block_ids() == [1, 2, 0]

    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]
    assert pool.free_block_queue.block_ids() == [0]


def test_freeing_a_request_tail_first_makes_its_tail_evicted_first():
    # A request's last blocks are the least likely to be shared by a later prompt, so the
    # manager frees blocks in reverse and the pool must keep that order.
    pool = BlockPool(4, enable_caching=True)
    request_blocks = pool.get_new_blocks(4)

    pool.free_blocks(reversed(request_blocks))

    assert pool.free_block_queue.block_ids() == [3, 2, 1, 0]
    assert pool.get_new_blocks(1)[0].block_id == 3


def test_module_docstring_example_holds_exactly():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (0, 1)
    assert pool.free_block_queue.block_ids() == [2, 3]

    pool.cache_block(a, HASH_A, [5, 6])
    pool.free_blocks([b, a])
    assert pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    assert a.block_hash == HASH_A and a.block_tokens == (5, 6)
    assert pool.get_cached_block(HASH_A, [5, 6]) is a
    assert pool.get_cached_block(HASH_A, [5, 7]) is None

    pool.touch([a])
    assert a.ref_cnt == 1
    assert pool.free_block_queue.block_ids() == [2, 3, 1]
    assert pool.num_free_blocks == 3


def test_touch_unlinks_a_revived_block_from_the_middle_of_the_queue():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    pool.cache_block(blocks[2], HASH_A, TOKENS_A)
    pool.free_blocks(blocks)
    assert pool.free_block_queue.block_ids() == [0, 1, 2, 3, 4]

    pool.touch([blocks[2]])

    # O(1) removal: the neighbours are relinked to each other directly and the revived block
    # keeps no links into the queue.
    assert blocks[1].next_free is blocks[3]
    assert blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert pool.free_block_queue.block_ids() == [0, 1, 3, 4]
    assert pool.num_free_blocks == 4
    # Revival keeps the hash: the block is still a prefix-cache hit for others.
    assert pool.get_cached_block(HASH_A, TOKENS_A) is blocks[2]
    # The remaining queue still pops in the same order.
    assert [b.block_id for b in pool.get_new_blocks(4)] == [0, 1, 3, 4]


def test_touch_unlinks_head_and_tail_of_the_queue():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(blocks)

    pool.touch([blocks[0], blocks[3]])

    assert pool.free_block_queue.block_ids() == [1, 2]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]
    assert pool.num_free_blocks == 0


def test_touching_a_held_block_only_adds_a_reference():
    pool = BlockPool(3, enable_caching=True)
    (held,) = pool.get_new_blocks(1)

    pool.touch([held])

    assert held.ref_cnt == 2
    assert pool.free_block_queue.block_ids() == [1, 2]


def test_eviction_drops_the_hash_from_cached_blocks():
    pool = BlockPool(2, enable_caching=True)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, HASH_A, TOKENS_A)
    pool.cache_block(b1, HASH_B, TOKENS_B)
    pool.free_blocks([b0, b1])

    (reused,) = pool.get_new_blocks(1)

    assert reused is b0
    assert reused.block_hash is None
    assert pool.get_cached_block(HASH_A, TOKENS_A) is None
    assert pool.cached_blocks == {HASH_B: b1}


def test_two_holders_of_one_block():
    pool = BlockPool(2, enable_caching=True)
    (shared,) = pool.get_new_blocks(1)
    pool.touch([shared])  # a second request hits the same prefix block

    pool.free_blocks([shared])
    assert shared.ref_cnt == 1
    assert pool.free_block_queue.block_ids() == [1]

    pool.free_blocks([shared])
    assert shared.ref_cnt == 0
    assert pool.free_block_queue.block_ids() == [1, 0]

    with pytest.raises(RuntimeError, match="freed more often than allocated"):
        pool.free_blocks([shared])


def test_cache_block_first_block_with_a_hash_wins():
    pool = BlockPool(2, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, HASH_A, TOKENS_A)

    # The same content computed privately by another request.
    pool.cache_block(second, HASH_A, TOKENS_A)
    pool.cache_block(first, HASH_C, TOKENS_C)  # a block keeps the hash it was registered with

    assert second.block_hash is None
    assert first.block_hash == HASH_A
    assert pool.cached_blocks == {HASH_A: first}


def test_cache_block_is_a_no_op_without_caching():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)

    pool.cache_block(block, HASH_A, TOKENS_A)

    assert block.block_hash is None
    assert pool.cached_blocks == {}


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    pool = BlockPool(2, enable_caching=True)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, HASH_A, TOKENS_A)
    pool.cache_block(b1, HASH_B, TOKENS_B)
    pool.free_blocks([b0])

    assert pool.reset_prefix_cache() is False
    assert pool.cached_blocks == {HASH_A: b0, HASH_B: b1}
    assert b0.block_hash == HASH_A

    pool.free_blocks([b1])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {}
    assert (b0.block_hash, b1.block_hash) == (None, None)
    # The free queue itself is untouched by the reset.
    assert pool.free_block_queue.block_ids() == [0, 1]


def test_get_new_blocks_beyond_free_raises_and_takes_nothing():
    pool = BlockPool(2, enable_caching=True)
    pool.get_new_blocks(1)

    with pytest.raises(ValueError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)

    assert pool.free_block_queue.block_ids() == [1]


def test_usage_counts_cached_free_blocks_as_free():
    pool = BlockPool(4, enable_caching=True)
    _, b1 = pool.get_new_blocks(2)
    assert pool.usage() == 0.5

    pool.cache_block(b1, HASH_A, TOKENS_A)
    pool.free_blocks([b1])
    assert pool.usage() == 0.25


def test_pool_needs_at_least_one_block():
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(0, enable_caching=True)


# ---- the token check on a hit --------------------------------------------------------------


def test_a_key_found_with_other_tokens_is_a_miss():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, HASH_A, TOKENS_A)

    # Same key, other contents (a clash): the block's KV is not theirs.
    assert pool.get_cached_block(HASH_A, TOKENS_B) is None
    assert pool.get_cached_block(HASH_A, TOKENS_A[:3]) is None
    assert pool.get_cached_block(HASH_A, list(TOKENS_A)) is block


def test_eviction_and_reset_forget_the_cached_tokens():
    pool = BlockPool(2, enable_caching=True)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, HASH_A, TOKENS_A)
    pool.cache_block(b1, HASH_B, TOKENS_B)
    pool.free_blocks([b0, b1])

    (reused,) = pool.get_new_blocks(1)
    assert reused is b0 and reused.block_tokens is None

    pool.free_blocks([reused])
    assert pool.reset_prefix_cache() is True
    assert (b0.block_tokens, b1.block_tokens) == (None, None)
