"""Per-request block tables on top of the BlockPool, with prefix caching.

Prefix caching: full block ``i`` of a request is keyed by ``widellm.core.block_hash``'s chain
(sha256 over the key of block ``i - 1``, the tokens of block ``i`` and, for the first block,
the request's ``cache_salt``), so equal keys mean equal whole prefixes under equal salts. A
new request looks its keys up in order and reuses the longest run of hits whose cached
tokens match its own; the last token of a prompt is always computed so that the model
produces logits for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from widellm.core.block_hash import cache_salt_extra_keys, chain_block_hashes
from widellm.core.block_pool import BlockPool, KVCacheBlock
from widellm.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache counters in tokens, as vLLM reports them.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        start = len(hashes) * bs
        if start + bs > len(tokens):  # the common decode step: no block filled up
            return
        if hashes:
            hashes.extend(chain_block_hashes(tokens[start:], bs, parent=hashes[-1]))
        else:
            hashes.extend(chain_block_hashes(
                tokens, bs, first_extra_keys=cache_salt_extra_keys(request.cache_salt)))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached blocks at the start of ``request``; (blocks, tokens covered).

        Requests asking for prompt logprobs skip the cache: those need logits for every
        prompt position."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self.update_block_hashes(request)
        bs = self.block_size
        max_hit_blocks = (request.num_tokens - 1) // bs
        tokens = request.all_token_ids
        hits: list[KVCacheBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            block = self.block_pool.get_cached_block(block_hash, tokens[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_cache_stats(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every retry of a request kept waiting)."""
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` after the computed ones (plus ``new_computed_blocks``,
        prefix hits not yet counted in ``request.num_computed_tokens``). With
        ``delay_cache_blocks`` the new blocks join the prefix cache only at
        :meth:`cache_blocks` (a remote load fills them later: nobody may hit them before).

        Returns the newly allocated blocks, or None (changing nothing) when the pool is short.
        """
        bs = self.block_size
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is not None and not new_computed_blocks:
            # The common decode step: its blocks already hold the new tokens and no block
            # fills up (the block hashes extend lazily, when a block is next cached or
            # looked up). Same result as the general path, at a fraction of its cost (the
            # simulator schedules millions of these).
            total_tokens = request.num_computed_tokens + num_new_tokens
            if total_tokens <= len(blocks) * bs and (
                    not self.enable_caching
                    or total_tokens // bs <= self.num_cached_blocks.get(rid, 0)):
                return []
        if blocks is None:
            blocks = self.req_to_blocks[rid] = []
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        total_tokens = num_computed + num_new_tokens
        num_required = -(-total_tokens // bs)
        num_to_allocate = num_required - len(blocks) - len(new_computed_blocks)
        # Hits sitting in the free queue stop being allocatable once revived.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_to_allocate > self.block_pool.num_free_blocks - num_revived:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None

        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_to_allocate, 0))
        blocks.extend(new_blocks)
        if not delay_cache_blocks:
            self._cache_full_blocks(request, blocks, total_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Put the full blocks of ``request``'s first ``num_tokens`` into the prefix cache."""
        self._cache_full_blocks(request, self.req_to_blocks[request.request_id], num_tokens)

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        # Cached as soon as scheduled: a sibling scheduled later in the same step may hit them,
        # which is safe because every token's KV is stored before any attention reads it.
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        bs = self.block_size
        num_full = min(num_tokens // bs, len(request.block_hashes))
        start = self.num_cached_blocks.get(request.request_id, 0)
        tokens = request.all_token_ids
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i],
                                        tokens[i * bs:(i + 1) * bs])
        self.num_cached_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
