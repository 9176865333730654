"""The frontend's data-parallel load balancer: least loaded rank, unless a rank likely holds the
prompt's prefix in its KV cache and is not much busier.

Load
    ``load(r) = waiting_weight * waiting(r) + running_weight * running(r)``, in units of one
    running request. ``waiting``/``running`` are the counts of rank ``r``'s last scheduler stats,
    corrected by what the frontend did since: every request sent there counts as waiting (it
    queues on arrival), every finished one comes off running (or off waiting when none run).
    So a burst arriving between two stats reports spreads instead of piling onto the rank that
    looked idle. The next report replaces the estimate. Defaults: waiting 4, running 1. A
    waiting request still has its whole prefill ahead and is queued behind the running batch,
    so a new request lands behind it and waits for that prefill; a running request only adds
    one row to each decode step, slowing every step a little.

Prefix awareness
    Per rank, a bounded LRU index of the chained keys of the full blocks of the prompts sent
    there (the engine's own ``widellm.core.block_hash`` keys, salted by the request's
    ``cache_salt`` exactly as the engine salts them: block ``i``'s key covers the whole prefix
    up to it, so a prompt only matches blocks its salt may share). A prompt's match on a rank
    is its longest run of leading block keys found there; a partial last block never counts.
    A match of ``m >= min_prefix_blocks`` blocks earns the rank a credit
    ``slack(m) = min(max_prefix_slack, prefix_slack_per_block * m)`` load units. The rank chosen minimises ``load - credit``. Equivalently: a rank with a long enough match
    wins over the least loaded rank iff its load exceeds it by at most ``slack(m)``; a longer
    prefix saves more prefill, so it is worth more queueing. Defaults: 0.5 per block (8 blocks
    earn one waiting request's worth, 4 units) capped at 16 (four waiting requests). The cap
    keeps a hot prefix (a shared system prompt) from piling onto one rank: once that rank is
    four waiting requests ahead, the prompt goes to a less loaded rank, which then caches the
    prefix too, so hot prefixes get replicated. The index is a hint, not the truth: engines
    evict on their own.

Ties
    On equal ``load - credit`` the longer match wins, then round robin: the first rank at or
    after a cursor that moves past every chosen rank. So a burst of equal requests onto idle
    ranks goes 0, 1, ..., N-1, 0, 1, ... and sequential requests on an idle deployment use every
    rank's KV cache, not only rank 0's.

Cost
    ``choose_rank`` hashes the prompt's full blocks once and probes each rank's dict per block
    until the rank misses: O(prompt blocks x ranks) dict lookups, never a scan of the index.
    Recording the prompt is O(prompt blocks); eviction pops the LRU end, O(1) per block.

Callers handle one engine message in order: ``request_finished`` for the requests it finished,
then ``update_stats`` with its stats (which already exclude them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from widellm.core.block_hash import BlockHash, cache_salt_extra_keys, chain_block_hashes

DEFAULT_WAITING_WEIGHT = 4.0
DEFAULT_RUNNING_WEIGHT = 1.0
DEFAULT_MIN_PREFIX_BLOCKS = 4
DEFAULT_PREFIX_SLACK_PER_BLOCK = 0.5
DEFAULT_MAX_PREFIX_SLACK = 16.0


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_number(name: str, value: object, *, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > 0 if positive else value >= 0)  # also rejects NaN
    if not ok:
        raise ValueError(f"{name} must be a number {'>' if positive else '>='} 0, got {value!r}")


class DPLoadBalancer:
    """Chooses the data-parallel rank of each request; see the module docstring for the policy.

    Example (2 ranks, blocks of 4 tokens)::

        lb = DPLoadBalancer(2, 4, max_tracked_blocks=1024)
        lb.choose_rank(list(range(40)))   # 0: both idle, round robin starts at 0
        lb.choose_rank([7] * 40)          # 1: rank 0 has one waiting request (load 4)
        lb.choose_rank(list(range(41)))   # 0: 10-block match, credit 5: 4 - 5 < 4
        lb.request_finished(0)
        lb.update_stats(0, num_waiting=0, num_running=1)
    """

    def __init__(
        self,
        num_ranks: int,
        block_size: int,
        *,
        max_tracked_blocks: int,
        min_prefix_blocks: int = DEFAULT_MIN_PREFIX_BLOCKS,
        prefix_slack_per_block: float = DEFAULT_PREFIX_SLACK_PER_BLOCK,
        max_prefix_slack: float = DEFAULT_MAX_PREFIX_SLACK,
        waiting_weight: float = DEFAULT_WAITING_WEIGHT,
        running_weight: float = DEFAULT_RUNNING_WEIGHT,
    ) -> None:
        _check_int("num_ranks", num_ranks, 1)
        _check_int("block_size", block_size, 1)
        _check_int("max_tracked_blocks", max_tracked_blocks, 1)
        _check_int("min_prefix_blocks", min_prefix_blocks, 1)
        _check_number("prefix_slack_per_block", prefix_slack_per_block, positive=False)
        _check_number("max_prefix_slack", max_prefix_slack, positive=False)
        _check_number("waiting_weight", waiting_weight, positive=True)
        _check_number("running_weight", running_weight, positive=True)
        self.num_ranks = num_ranks
        self.block_size = block_size
        self.max_tracked_blocks = max_tracked_blocks
        self.min_prefix_blocks = min_prefix_blocks
        self.prefix_slack_per_block = prefix_slack_per_block
        self.max_prefix_slack = max_prefix_slack
        self.waiting_weight = waiting_weight
        self.running_weight = running_weight
        # Estimated queue of each rank: last reported counts plus the frontend's corrections.
        self._num_waiting = [0] * num_ranks
        self._num_running = [0] * num_ranks
        # Requests this frontend sent to each rank and not yet saw finish.
        self._num_in_flight = [0] * num_ranks
        # Per rank: block key -> None, least recently recorded first.
        self._blocks: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(num_ranks)]
        self._next_rank = 0  # round-robin cursor for ties

    # ---- queries -------------------------------------------------------------------------

    def load(self, rank: int) -> float:
        """Estimated load of ``rank``, in units of one running request."""
        self._check_rank(rank)
        return (self.waiting_weight * self._num_waiting[rank]
                + self.running_weight * self._num_running[rank])

    def num_in_flight(self, rank: int) -> int:
        """Requests sent to ``rank`` by this balancer and not finished yet."""
        self._check_rank(rank)
        return self._num_in_flight[rank]

    def num_tracked_blocks(self, rank: int) -> int:
        """Block hashes held in ``rank``'s prefix index (at most ``max_tracked_blocks``)."""
        self._check_rank(rank)
        return len(self._blocks[rank])

    def prefix_match_blocks(self, prompt_token_ids: Sequence[int],
                            cache_salt: str | None = None) -> list[int]:
        """Per rank, how many leading full blocks of the prompt its index holds."""
        return self._match(self.block_hashes(prompt_token_ids, cache_salt))

    def block_hashes(self, token_ids: Sequence[int],
                     cache_salt: str | None = None) -> list[BlockHash]:
        """Keys of the prompt's full blocks, as the engine's prefix cache computes them."""
        return chain_block_hashes(token_ids, self.block_size,
                                  first_extra_keys=cache_salt_extra_keys(cache_salt))

    # ---- events --------------------------------------------------------------------------

    def choose_rank(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Pick the rank for a new request, count it in flight there and record its prompt's
        full blocks as (probably) cached there."""
        hashes = self.block_hashes(prompt_token_ids, cache_salt)
        match = self._match(hashes)
        n = self.num_ranks

        def key(rank: int) -> tuple[float, int, int]:
            return (self.load(rank) - self._credit(match[rank]), -match[rank],
                    (rank - self._next_rank) % n)

        rank = min(range(n), key=key)
        self._next_rank = (rank + 1) % n
        self._assign(rank, hashes)
        return rank

    def assign(self, rank: int, prompt_token_ids: Sequence[int],
               cache_salt: str | None = None) -> None:
        """Count a request sent to ``rank`` by the caller's choice (a pinned
        ``data_parallel_rank``, or the further samples of an ``n > 1`` request, which share
        their prompt's blocks and so must go where the first went)."""
        self._check_rank(rank)
        self._assign(rank, self.block_hashes(prompt_token_ids, cache_salt))

    def _assign(self, rank: int, hashes: list[BlockHash]) -> None:
        self._num_waiting[rank] += 1
        self._num_in_flight[rank] += 1
        self._record(rank, hashes)

    def update_stats(self, rank: int, num_waiting: int, num_running: int) -> None:
        """Replace ``rank``'s estimated queue by its latest scheduler stats."""
        self._check_rank(rank)
        _check_int("num_waiting", num_waiting, 0)
        _check_int("num_running", num_running, 0)
        self._num_waiting[rank] = num_waiting
        self._num_running[rank] = num_running

    def request_finished(self, rank: int) -> None:
        """A request this balancer sent to ``rank`` finished or was aborted; call once each."""
        self._check_rank(rank)
        if self._num_in_flight[rank] == 0:
            raise ValueError(f"rank {rank} has no request in flight to finish")
        self._num_in_flight[rank] -= 1
        if self._num_running[rank] > 0:
            self._num_running[rank] -= 1
        elif self._num_waiting[rank] > 0:
            self._num_waiting[rank] -= 1

    # ---- internals -----------------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be an int in [0, {self.num_ranks}), got {rank!r}")

    def _match(self, hashes: list[BlockHash]) -> list[int]:
        """Per rank, the length of the leading run of ``hashes`` found in its index."""
        match = [0] * self.num_ranks
        alive = range(self.num_ranks)
        for i, block_hash in enumerate(hashes):
            alive = [r for r in alive if block_hash in self._blocks[r]]
            if not alive:
                break
            for r in alive:
                match[r] = i + 1
        return match

    def _credit(self, num_matched_blocks: int) -> float:
        """Load units a prefix match of that many blocks may outweigh."""
        if num_matched_blocks < self.min_prefix_blocks:
            return 0.0
        return min(self.max_prefix_slack, self.prefix_slack_per_block * num_matched_blocks)

    def _record(self, rank: int, hashes: list[BlockHash]) -> None:
        """Mark the blocks most recently used on ``rank``, the first block last: eviction then
        drops a prefix's deepest blocks first, which keeps its shorter prefixes matchable (the
        engine frees a request's blocks tail first for the same reason)."""
        index = self._blocks[rank]
        for block_hash in reversed(hashes):
            index[block_hash] = None
            index.move_to_end(block_hash)
        while len(index) > self.max_tracked_blocks:
            index.popitem(last=False)
