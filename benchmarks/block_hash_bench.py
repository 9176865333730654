"""Cost of the prefix-cache keys per prompt: the previous ``hash((parent, tuple(tokens)))``
chain against the sha256 keys of ``widellm.core.block_hash`` (its block-by-block reference,
its one-conversion fast path, and the same path with blake2b as the digest), plus the
manager's whole per-prompt work (keys of a fresh request, and a lookup of a prompt whose
blocks are all cached, token check included)::

    .venv/bin/python benchmarks/block_hash_bench.py [--prompt-len 4096] [--block-size 16]

Each case: the median over ``--repeats`` runs of the mean over ``--iters`` prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import random
import statistics
import time
from unittest import mock

from widellm.core import block_hash
from widellm.core.block_hash import (
    ROOT_BLOCK_HASH, cache_salt_extra_keys, chain_block_hashes, hash_block_tokens,
)
from widellm.core.kv_cache_manager import KVCacheManager
from widellm.core.request import Request
from widellm.sampling_params import SamplingParams

US_PER_S = 1e6
# A Llama-style vocabulary: the ids' magnitude does not change the cost of either encoding.
VOCAB_SIZE = 32000


def old_chain(tokens: list[int], bs: int) -> list[int]:
    """The previous scheme (kv_cache_manager.hash_block_tokens before issue 21)."""
    parent, out = 0, []
    for start in range(0, len(tokens) - bs + 1, bs):
        parent = hash((parent, tuple(tokens[start:start + bs])))
        out.append(parent)
    return out


def reference_chain(tokens: list[int], bs: int, salt: str | None) -> list[bytes]:
    parent, out = ROOT_BLOCK_HASH, []
    extra = cache_salt_extra_keys(salt)
    for i, start in enumerate(range(0, len(tokens) - bs + 1, bs)):
        parent = hash_block_tokens(parent, tokens[start:start + bs], extra if i == 0 else ())
        out.append(parent)
    return out


def blake2b_digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=block_hash.BLOCK_HASH_BYTES).digest()


def time_us(fn, iters: int, repeats: int) -> float:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - start) / iters * US_PER_S)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    bs, n = args.block_size, args.prompt_len
    rng = random.Random(0)
    tokens = [rng.randrange(VOCAB_SIZE) for _ in range(n)]
    salt = "tenant-a"
    assert reference_chain(tokens, bs, salt) == chain_block_hashes(
        tokens, bs, first_extra_keys=cache_salt_extra_keys(salt))

    def new_request() -> Request:
        return Request("r", tokens, SamplingParams(), frozenset(), 1, cache_salt=salt)

    manager = KVCacheManager(n // bs + 1, bs, enable_caching=True)
    cached = new_request()
    hits, _ = manager.get_computed_blocks(cached)
    manager.allocate_slots(cached, cached.num_tokens, hits)
    probe = new_request()
    manager.update_block_hashes(probe)
    assert len(manager.get_computed_blocks(probe)[0]) == (n - 1) // bs

    def sha256_fast():
        chain_block_hashes(tokens, bs, first_extra_keys=cache_salt_extra_keys(salt))

    def blake2b_fast():
        with mock.patch.object(block_hash, "_digest", blake2b_digest):
            chain_block_hashes(tokens, bs, first_extra_keys=cache_salt_extra_keys(salt))

    cases = [
        ("old: hash((parent, tuple(tokens)))", lambda: old_chain(tokens, bs)),
        ("new reference: hash_block_tokens per block", lambda: reference_chain(tokens, bs, salt)),
        ("new fast: chain_block_hashes (sha256)", sha256_fast),
        ("same path, blake2b-256 digest", blake2b_fast),
        ("manager: keys of a fresh request", lambda: manager.update_block_hashes(new_request())),
        ("manager: lookup, all blocks hit (token check)",
         lambda: manager.get_computed_blocks(probe)),
    ]
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"{n}-token prompt, {n // bs} blocks of {bs}; median of {args.repeats} x "
          f"{args.iters} prompts")
    for name, fn in cases:
        print(f"  {name:48s} {time_us(fn, args.iters, args.repeats):9.1f} us / prompt")


if __name__ == "__main__":
    main()
