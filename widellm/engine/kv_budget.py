"""How many KV blocks a rank allocates.

In order of precedence:

* ``num_kv_blocks``: exactly that many.
* ``kv_cache_memory``: that many bytes for this rank (per rank, as in vLLM; four local ranks
  at ``--kv-cache-memory 4GiB`` take 16 GiB of the host).
* otherwise by need: the blocks ``max_num_seqs`` requests of ``max_model_len`` tokens can
  hold at once (``max_num_seqs * ceil(max_model_len / block_size)``), capped by the rank's
  share of ``kv_cache_memory_fraction`` of the available memory. On CPU every local rank
  draws from one host, so the launcher of the local ranks measures the host's available
  memory once, in ``share_host_memory`` (MemAvailable, or less where a memory cgroup limits
  the process: ``worker/host_memory.py``), and each rank gets ``fraction * available / local_ranks``: the
  ranks of one host together promise one fraction, never ``local_ranks`` fractions. On GPU
  each rank has its own device and takes the fraction of that device's free memory.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from widellm.config import EngineConfig
from widellm.worker.kv_cache import available_memory

logger = logging.getLogger(__name__)
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class KVBlockPlan:
    num_blocks: int
    reason: str  # why this many, for the start-up log line


def uses_host_budget(config: EngineConfig) -> bool:
    """Whether the pool is sized from a share of the host's memory (CPU, no explicit size)."""
    cc = config.cache_config
    return not config.on_cuda and cc.num_kv_blocks is None and cc.kv_cache_memory is None


def share_host_memory(config: EngineConfig) -> EngineConfig:
    """The config to hand this machine's ranks: with the host's available memory read once,
    before any of them allocates, so that their shares add up to one budget."""
    cc = config.cache_config
    if not uses_host_budget(config) or cc.host_available_memory is not None:
        return config
    memory = available_memory(config.device)
    available = memory.num_bytes
    local = config.parallel_config.local_size
    logger.info(
        "KV budget: %d bytes available x kv_cache_memory_fraction %r = %d bytes for the KV "
        "caches of this host, shared by %d local rank(s) (available: %s)",
        available, cc.kv_cache_memory_fraction,
        int(available * cc.kv_cache_memory_fraction), local, memory.source,
    )
    return config.replace(cache_config=dataclasses.replace(cc, host_available_memory=available))


def rank_budget_bytes(config: EngineConfig) -> int:
    """This rank's cap in bytes when no explicit size is given."""
    cc = config.cache_config
    if config.on_cuda:
        return int(available_memory(config.device).num_bytes * cc.kv_cache_memory_fraction)
    available = cc.host_available_memory
    if available is None:
        available = available_memory(config.device).num_bytes
    return int(available * cc.kv_cache_memory_fraction) // config.parallel_config.local_size


def blocks_needed(config: EngineConfig) -> int:
    """Blocks that max_num_seqs requests of max_model_len tokens hold at once: more can never
    be in use, so a larger pool only costs memory."""
    sc, block_size = config.scheduler_config, config.cache_config.block_size
    return sc.max_num_seqs * -(-sc.max_model_len // block_size)


def plan_num_blocks(config: EngineConfig, bytes_per_block: int) -> KVBlockPlan:
    cc = config.cache_config
    if cc.num_kv_blocks is not None:
        return KVBlockPlan(cc.num_kv_blocks, "num_kv_blocks")
    if cc.kv_cache_memory is not None:
        return KVBlockPlan(cc.kv_cache_memory // bytes_per_block,
                           f"kv_cache_memory {cc.kv_cache_memory} bytes")
    need = blocks_needed(config)
    budget = rank_budget_bytes(config)
    cap = budget // bytes_per_block
    if need <= cap:
        return KVBlockPlan(need, f"max_num_seqs x max_model_len, under this rank's "
                                 f"{budget}-byte budget")
    return KVBlockPlan(cap, f"this rank's {budget}-byte budget "
                            f"(max_num_seqs x max_model_len would use {need} blocks)")


def determine_num_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """The blocks to allocate, checked to hold one max_model_len request, and logged."""
    cc = config.cache_config
    plan = plan_num_blocks(config, bytes_per_block)
    num_blocks = plan.num_blocks
    if num_blocks < 1:
        raise ValueError(
            f"KV cache too small ({plan.reason}): one block needs {bytes_per_block} "
            "bytes; raise kv_cache_memory / kv_cache_memory_fraction"
        )
    max_len = config.scheduler_config.max_model_len
    if num_blocks * cc.block_size < max_len:
        # A request that can never fit would preempt itself forever.
        raise ValueError(
            f"max_model_len={max_len} is more than the KV cache holds "
            f"({num_blocks} blocks x {cc.block_size} = {num_blocks * cc.block_size} tokens, "
            f"{plan.reason}); raise kv_cache_memory / kv_cache_memory_fraction / "
            "num_kv_blocks or lower max_model_len"
        )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB = %d bytes (%d bytes per "
        "block; sized by %s)",
        num_blocks, cc.block_size, num_blocks * cc.block_size,
        num_blocks * bytes_per_block / GIB, num_blocks * bytes_per_block,
        bytes_per_block, plan.reason,
    )
    return num_blocks
