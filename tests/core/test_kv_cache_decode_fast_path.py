"""KVCacheManager.allocate_slots' decode fast path (no new block, no block filled up) leaves
the same state as the general path: decode a request token by token, and check after every
step the blocks, the cached-block count and the block hashes against a manager that only
ever takes the general path (every step asks for its tokens with an empty hit list of a
fresh tuple type, which the fast path does not take)."""

from __future__ import annotations

from tests.core.test_kv_cache_manager import BLOCK_SIZE, make_manager, make_request

PROMPT_LEN = 6
DECODE_STEPS = 13


class _NoHits(tuple):
    """An empty hit list the fast path sees as "hits given" (a non-empty-looking object):
    forces the general path with the same arguments."""

    def __bool__(self) -> bool:
        return True


def _decode(force_general: bool):
    manager = make_manager(16)
    req = make_request("r", list(range(10, 10 + PROMPT_LEN)))
    assert manager.allocate_slots(req, PROMPT_LEN) is not None
    req.num_computed_tokens = PROMPT_LEN
    calls = []
    real = manager.block_pool.get_new_blocks
    manager.block_pool.get_new_blocks = lambda n: calls.append(n) or real(n)
    trace = []
    for step in range(DECODE_STEPS):
        req.append_output_token(100 + step)
        hits = _NoHits() if force_general else ()
        new = manager.allocate_slots(req, 1, hits)
        req.num_computed_tokens += 1
        trace.append(([b.block_id for b in new], manager.get_block_ids("r"),
                      manager.num_cached_blocks.get("r"), list(req.block_hashes)))
    return trace, len(calls)


def test_fast_path_equals_general_path():
    (fast, fast_calls), (general, general_calls) = _decode(False), _decode(True)
    assert general_calls == DECODE_STEPS and fast_calls < DECODE_STEPS  # it was taken
    # Hashes extend lazily on the fast path: compare them where a block was cached.
    for (f_new, f_ids, f_cached, f_hashes), (g_new, g_ids, g_cached, g_hashes) in zip(
            fast, general):
        assert (f_new, f_ids, f_cached) == (g_new, g_ids, g_cached)
        assert f_hashes == g_hashes[:len(f_hashes)]
        assert len(f_hashes) >= f_cached
    # New blocks only where the tokens cross a block boundary.
    assert sum(1 for new, *_ in fast if new) == -(-(PROMPT_LEN + DECODE_STEPS) // BLOCK_SIZE) \
        - -(-PROMPT_LEN // BLOCK_SIZE)
