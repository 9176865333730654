"""The pool of KV cache blocks: reference counts, prefix-cache keys and an LRU free queue.

A block whose reference count drops to zero goes to the tail of the free queue but keeps its
key, so a later request with the same prefix can revive it. New allocations take from the
head, i.e. the least recently freed block is evicted first. Every operation is O(1) per block
(a lookup compares one block's token ids).

Keys are ``widellm.core.block_hash`` digests (bytes). A cached block also remembers the token
ids it holds, and a lookup whose tokens differ from them is a miss: should two contents ever
share a key, neither request reads the other's KV.

Example (4 blocks, caching on; ``key`` stands for a block's 32-byte hash)::

    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)          # ids 0, 1; free queue: [2, 3]
    pool.cache_block(a, key, [5, 6])       # a holds tokens 5, 6 under key
    pool.free_blocks([b, a])               # free queue: [2, 3, 1, 0]; 0 still cached
    pool.get_cached_block(key, [5, 6]) is a    # True: revivable until evicted
    pool.get_cached_block(key, [5, 7])     # None: same key, other tokens
    pool.touch([a])                        # ref 1 again, removed from the free queue
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from widellm.core.block_hash import BlockHash

# Hex digits of a block's key shown in its repr: enough to tell blocks apart in a log.
HASH_REPR_CHARS = 12


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "block_tokens", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # The token ids a cached block holds, checked on every hit.
        self.block_tokens: tuple[int, ...] | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        key = None if self.block_hash is None else self.block_hash.hex()[:HASH_REPR_CHARS]
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={key})"


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves, so removing a
    revived block from the middle is O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels keep the link updates branch-free
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (evicted first) to tail; for tests and debugging."""
        ids, node = [], self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash,
                         token_ids: Sequence[int]) -> KVCacheBlock | None:
        """The block cached under ``block_hash`` if it holds exactly ``token_ids``."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.block_tokens != tuple(token_ids):
            return None
        return block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving blocks that sat in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue in the given order
        (callers pass a request's blocks tail first, so its last blocks are evicted first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"{block} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash,
                    token_ids: Sequence[int]) -> None:
        """Register a full block holding ``token_ids`` under its chained key. A block with the
        same key that is already cached wins; the new one stays private to its request."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        block.block_tokens = tuple(token_ids)
        self.cached_blocks[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
        block.block_tokens = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.block_tokens = None
        self.cached_blocks.clear()
        return True
