"""Prefix-cache block keys: one cryptographic hash for every user of them (the block pool, the
KV cache manager, the data-parallel load balancer, and later a KV connector, for which a key
is the block's identity across instances).

Full block ``i`` of a request is keyed by the chain

    key(i) = sha256(key(i - 1) || u64(n) || i64(t_0) ... i64(t_{n-1}) || u64(m) || x_1 ... x_m)

with every integer little-endian, ``n`` the block's token count, ``t`` its token ids and
``x_1 ... x_m`` its extra keys (only the first block of a request carries any: its
``cache_salt`` now, LoRA or multimodal ids later; the chain carries them to every later
block). Each extra key is one type tag byte (``s`` str as UTF-8, ``b`` bytes, ``i`` int as
i64), a u64 payload length, and the payload, so no two different key sets share an encoding.
Equal keys therefore mean equal token prefixes under equal extra keys, barring a sha256
collision.

``key(-1)`` is ``ROOT_BLOCK_HASH = sha256(b"widellm.block_hash.v1")``: fixed, not random, so
the same content gets the same key in every process, run and instance; the version in it
changes whenever the encoding does, so keys of two encodings never alias.

Why not Python's ``hash((parent, tuple(tokens)))`` (the previous scheme): it is 64 bits of a
non-cryptographic function, so colliding prefixes can be found on purpose (the tests carry
two such 16-token blocks, found in seconds) and then share KV across requests and users.
blake2b is not cheaper here (measured, docs/BENCHMARKS.md); sha256 uses the CPU's SHA
instructions.

Hand-checkable example (one block of two tokens, no extra keys)::

    >>> import hashlib, struct
    >>> data = ROOT_BLOCK_HASH + struct.pack("<Qqq", 2, 1, 2) + struct.pack("<Q", 0)
    >>> hash_block_tokens(ROOT_BLOCK_HASH, [1, 2]) == hashlib.sha256(data).digest()
    True
    >>> hash_block_tokens(ROOT_BLOCK_HASH, [1, 2]).hex()[:16]
    '68ce0dfc544a4f71'
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

BlockHash = bytes
# Extra keys of a request's first block, e.g. ("cache_salt", "tenant-a").
ExtraKeys = tuple[str | bytes | int, ...]

ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"widellm.block_hash.v1").digest()
# Every key is a sha256 digest.
BLOCK_HASH_BYTES = 32
# Bytes per token id in the encoding (int64: every vocabulary fits).
TOKEN_BYTES = 8
# Extra keys' name for the request's cache salt; a name, so a later kind of extra key (a LoRA
# id) can never be mistaken for a salt with the same value.
CACHE_SALT_KEY = "cache_salt"

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_NO_EXTRA_KEYS = _U64.pack(0)


def _digest(data: bytes) -> BlockHash:
    return hashlib.sha256(data).digest()


def encode_extra_keys(extra_keys: ExtraKeys) -> bytes:
    """The canonical bytes of ``extra_keys``: count, then per key tag + length + payload."""
    parts = [_U64.pack(len(extra_keys))]
    for key in extra_keys:
        if isinstance(key, str):
            tag, payload = b"s", key.encode("utf-8")
        elif isinstance(key, bytes):
            tag, payload = b"b", key
        elif isinstance(key, int) and not isinstance(key, bool):
            tag, payload = b"i", _I64.pack(key)
        else:
            raise TypeError(f"extra keys must be str, bytes or int, got {type(key).__name__}")
        parts += [tag, _U64.pack(len(payload)), payload]
    return b"".join(parts)


def cache_salt_extra_keys(cache_salt: str | None) -> ExtraKeys:
    """Extra keys of a request's first block for its ``cache_salt`` (none without one, so
    unsalted requests keep sharing blocks with each other)."""
    return () if cache_salt is None else (CACHE_SALT_KEY, cache_salt)


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int],
                      extra_keys: ExtraKeys = ()) -> BlockHash:
    """The key of one block: the plain reference of the encoding, one block at a time."""
    if len(parent) != BLOCK_HASH_BYTES:
        raise ValueError(f"parent must be a {BLOCK_HASH_BYTES}-byte block hash, "
                         f"got {len(parent)} bytes")
    n = len(token_ids)
    tokens = struct.pack(f"<Q{n}q", n, *token_ids)
    return _digest(parent + tokens + encode_extra_keys(extra_keys))


def chain_block_hashes(token_ids: Sequence[int], block_size: int, *,
                       parent: BlockHash = ROOT_BLOCK_HASH,
                       first_extra_keys: ExtraKeys = ()) -> list[BlockHash]:
    """Keys of the full blocks of ``token_ids`` (a partial last block gets none), chained from
    ``parent``; ``first_extra_keys`` go into the first of them. Equal to calling
    ``hash_block_tokens`` block by block, but encodes all tokens with one numpy conversion
    (the per-block ``struct.pack`` costs more than the hashing)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if len(parent) != BLOCK_HASH_BYTES:
        raise ValueError(f"parent must be a {BLOCK_HASH_BYTES}-byte block hash, "
                         f"got {len(parent)} bytes")
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    data = np.asarray(token_ids[:num_full * block_size], dtype="<i8").tobytes()
    header = _U64.pack(block_size)
    stride = block_size * TOKEN_BYTES
    hashes = []
    extra = encode_extra_keys(first_extra_keys)
    for start in range(0, len(data), stride):
        parent = _digest(parent + header + data[start:start + stride] + extra)
        hashes.append(parent)
        extra = _NO_EXTRA_KEYS
    return hashes
