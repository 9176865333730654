"""KV pool sizing (engine/kv_budget.py) and the per-rank seed derivation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from widellm.engine.arg_utils import EngineArgs
from widellm.engine.kv_budget import blocks_needed, plan_num_blocks, share_host_memory
from widellm.worker.sampler import engine_core_seed

BYTES_PER_BLOCK = 16384  # any value: the plan only divides by it
GIB = 1 << 30


@pytest.fixture(scope="module")
def config_for(model_dir):
    path = model_dir("LlamaForCausalLM")

    def make(host_available=None, **kwargs):
        kwargs = {"dtype": "float32", "max_model_len": 100, "max_num_seqs": 4, **kwargs}
        config = EngineArgs(model=path, **kwargs).create_engine_config()
        return config.replace(cache_config=dataclasses.replace(
            config.cache_config, host_available_memory=host_available))

    return make


def test_default_pool_is_what_max_num_seqs_full_requests_use(config_for):
    config = config_for(host_available=64 * GIB)
    assert blocks_needed(config) == 4 * 7  # ceil(100 / 16) = 7 blocks per request
    assert plan_num_blocks(config, BYTES_PER_BLOCK).num_blocks == 28


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_local_ranks_split_one_capped_budget(config_for, dp):
    host = 10_000 * BYTES_PER_BLOCK + 12345
    config = config_for(host_available=host, kv_cache_memory_fraction=0.5, max_num_seqs=4096,
                        data_parallel_size=dp)
    plan = plan_num_blocks(config, BYTES_PER_BLOCK)
    budget = int(host * 0.5)
    assert plan.num_blocks == budget // dp // BYTES_PER_BLOCK  # 5000, 2500, 1250
    assert plan.num_blocks == {1: 5000, 2: 2500, 4: 1250}[dp]
    assert dp * plan.num_blocks * BYTES_PER_BLOCK <= budget


def test_explicit_kv_cache_memory_is_per_rank(config_for):
    config = config_for(kv_cache_memory="1MiB", data_parallel_size=4)
    assert plan_num_blocks(config, BYTES_PER_BLOCK).num_blocks == 64
    assert plan_num_blocks(config_for(num_kv_blocks=9), BYTES_PER_BLOCK).num_blocks == 9


def test_launcher_reads_host_memory_once_unless_sized_explicitly(config_for):
    shared = share_host_memory(config_for(data_parallel_size=2))
    assert shared.cache_config.host_available_memory > 0
    # Already measured, or sized by bytes: nothing to share.
    assert share_host_memory(shared) is shared
    explicit = config_for(kv_cache_memory="1MiB", data_parallel_size=2)
    assert share_host_memory(explicit) is explicit


def test_rank_seeds_are_reproducible_and_distinct():
    seeds = {(s, r): engine_core_seed(s, r) for s in range(3) for r in range(4)}
    assert len(set(seeds.values())) == len(seeds)  # (0, 1) and (1, 0) included
    assert engine_core_seed(7, 1) == engine_core_seed(7, 1)
    assert all(0 <= v < 1 << 63 for v in seeds.values())
    a = torch.Generator().manual_seed(engine_core_seed(7, 0))
    b = torch.Generator().manual_seed(engine_core_seed(7, 0))
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
