"""A genuine collision of the previous prefix-cache key, ``hash((parent, tuple(tokens)))``.

Two 16-token blocks of ids below 32000 (a common vocabulary size) whose CPython tuple hashes
are equal, so their old keys are equal for every parent and every later block's key too. For
ints ``hash`` is the value itself and the tuple hash (xxHash-style, CPython >= 3.8) does not
depend on PYTHONHASHSEED, so the collision holds in every process.

Found by a birthday search in a few seconds: the tuple hash takes the last item in as
``rotl(acc + h * P2, 31) * P1``, so two 15-token prefixes whose accumulators differ by
``d * P2`` with ``0 <= d < 32000`` collide once their last tokens are ``d`` and ``0``;
vectorised over 2^25 choices of the first two tokens (numpy uint64) and sorting
``acc * P2^-1`` finds such a pair (the closest pair is expected to be ~2^14 apart).
"""

from __future__ import annotations

# Shared middle tokens of both blocks.
_MIDDLE = [13, 7932, 15851, 23770, 31689, 7608, 15527, 23446, 31365, 7284, 15203, 23122, 31041]
COLLIDING_BLOCK_A = [1738, 1932, *_MIDDLE, 29311]
COLLIDING_BLOCK_B = [1705, 2964, *_MIDDLE, 0]
COLLIDING_BLOCK_SIZE = 16
# The old scheme's parent of a request's first block.
OLD_ROOT_BLOCK_HASH = 0


def old_hash_block_tokens(parent_hash: int, token_ids: list[int]) -> int:
    """The previous ``widellm.core.kv_cache_manager.hash_block_tokens``, verbatim."""
    return hash((parent_hash, tuple(token_ids)))


def old_chain_block_hashes(token_ids: list[int], block_size: int, *,
                           parent: int = OLD_ROOT_BLOCK_HASH, first_extra_keys=()) -> list[int]:
    """The previous chain, in the shape of ``block_hash.chain_block_hashes`` (it had no extra
    keys), to put the old scheme back into the manager for a test."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = old_hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
