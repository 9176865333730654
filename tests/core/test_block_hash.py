"""Prefix-cache block keys: the exact encoding, the fast chain against its plain reference,
unambiguous extra keys, salts, and a real collision of the previous scheme that the new one
tells apart."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from tests.core.old_hash_collision import (
    COLLIDING_BLOCK_A, COLLIDING_BLOCK_B, OLD_ROOT_BLOCK_HASH, old_hash_block_tokens,
)
from widellm.core.block_hash import (
    BLOCK_HASH_BYTES, ROOT_BLOCK_HASH, cache_salt_extra_keys, chain_block_hashes,
    encode_extra_keys, hash_block_tokens,
)

# sha256(b"widellm.block_hash.v1"): pinned, because a key is a block's identity across
# processes and instances; a change of encoding must change the version in the root.
ROOT_HEX = "36a8e3ea0bd97fd02088a09774a297017f803a2c1986b29a4cfff65f66296565"


def test_root_is_the_documented_fixed_value():
    assert ROOT_BLOCK_HASH == hashlib.sha256(b"widellm.block_hash.v1").digest()
    assert len(ROOT_BLOCK_HASH) == BLOCK_HASH_BYTES
    assert ROOT_BLOCK_HASH.hex() == ROOT_HEX


def test_docstring_example_and_the_exact_encoding():
    # parent || u64 token count || i64 tokens || u64 extra-key count || (tag, u64 len, bytes)*
    data = ROOT_BLOCK_HASH + struct.pack("<Qqq", 2, 1, 2) + struct.pack("<Q", 0)
    key = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2])
    assert key == hashlib.sha256(data).digest()
    assert key.hex()[:16] == "68ce0dfc544a4f71"

    salted = (ROOT_BLOCK_HASH + struct.pack("<Qqq", 2, 1, 2) + struct.pack("<Q", 2)
              + b"s" + struct.pack("<Q", 10) + b"cache_salt" + b"s" + struct.pack("<Q", 1) + b"t")
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 2], ("cache_salt", "t")) == \
        hashlib.sha256(salted).digest()


def test_extra_keys_encode_unambiguously():
    variants = [(), ("ab", "c"), ("a", "bc"), ("abc",), ("1",), (1,), (b"1",), ("",), ("", ""),
                (-1,), (2**63 - 1,), ("é",)]
    encodings = {encode_extra_keys(v) for v in variants}
    assert len(encodings) == len(variants)
    keys = {hash_block_tokens(ROOT_BLOCK_HASH, [5, 6], v) for v in variants}
    assert len(keys) == len(variants)
    with pytest.raises(TypeError, match="extra keys must be str, bytes or int"):
        encode_extra_keys((1.5,))
    with pytest.raises(TypeError, match="extra keys must be str, bytes or int"):
        encode_extra_keys((True,))


def test_token_count_and_parent_are_part_of_the_key():
    two = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2])
    assert two != hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 0])
    other_parent = hash_block_tokens(ROOT_BLOCK_HASH, [9])
    assert hash_block_tokens(other_parent, [1, 2]) != hash_block_tokens(ROOT_BLOCK_HASH, [1, 2])
    with pytest.raises(ValueError, match="parent must be a 32-byte block hash"):
        hash_block_tokens(b"\0" * 8, [1, 2])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_fast_chain_equals_the_block_by_block_reference(block_size):
    rng = random.Random(block_size)
    for length in [0, block_size - 1, block_size, 5 * block_size + 3, 40 * block_size]:
        tokens = [rng.randrange(200_000) for _ in range(length)]
        for extra in [(), cache_salt_extra_keys("tenant-a")]:
            expected, parent = [], ROOT_BLOCK_HASH
            for i in range(length // block_size):
                block = tokens[i * block_size:(i + 1) * block_size]
                parent = hash_block_tokens(parent, block, extra if i == 0 else ())
                expected.append(parent)
            assert chain_block_hashes(tokens, block_size, first_extra_keys=extra) == expected
            # Continuing a chain from its last key gives the same keys as one call.
            if len(expected) >= 2:
                head = chain_block_hashes(tokens[:block_size], block_size,
                                          first_extra_keys=extra)
                tail = chain_block_hashes(tokens[block_size:], block_size, parent=head[-1])
                assert head + tail == expected


def test_salts_separate_every_block_and_equal_salts_share():
    tokens = list(range(100, 148))  # 3 blocks of 16
    plain = chain_block_hashes(tokens, 16)
    a = chain_block_hashes(tokens, 16, first_extra_keys=cache_salt_extra_keys("a"))
    a_again = chain_block_hashes(tokens, 16, first_extra_keys=cache_salt_extra_keys("a"))
    b = chain_block_hashes(tokens, 16, first_extra_keys=cache_salt_extra_keys("b"))
    assert cache_salt_extra_keys(None) == ()
    assert plain == chain_block_hashes(tokens, 16, first_extra_keys=cache_salt_extra_keys(None))
    assert a == a_again
    for i in range(3):
        assert len({plain[i], a[i], b[i]}) == 3


def test_a_collision_of_the_old_scheme_gets_two_keys():
    # The old keys collide for real (no monkeypatching): for the root and for any parent.
    assert COLLIDING_BLOCK_A != COLLIDING_BLOCK_B
    assert max(COLLIDING_BLOCK_A + COLLIDING_BLOCK_B) < 32000
    old_a = old_hash_block_tokens(OLD_ROOT_BLOCK_HASH, COLLIDING_BLOCK_A)
    assert old_a == old_hash_block_tokens(OLD_ROOT_BLOCK_HASH, COLLIDING_BLOCK_B)
    assert old_a == -9113082777850661606
    assert (old_hash_block_tokens(old_a, [7] * 16)
            == old_hash_block_tokens(old_hash_block_tokens(0, COLLIDING_BLOCK_B), [7] * 16))

    new_a = chain_block_hashes(COLLIDING_BLOCK_A + [7] * 16, 16)
    new_b = chain_block_hashes(COLLIDING_BLOCK_B + [7] * 16, 16)
    assert new_a[0] != new_b[0] and new_a[1] != new_b[1]
