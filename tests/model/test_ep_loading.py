"""Expert-parallel loading: each rank holds and reads only its own routed experts (1/EP of
them), plus the replicated attention, dense and shared-expert weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.conftest import TINY_MODELS
from tests.dist_utils import run_ranks
from widellm.distributed.ep_context import ExpertParallelContext
from widellm.layers.moe.layer import FusedMoE
from widellm.model import loader
from widellm.model.presets import resolve_preset

TIMEOUT_S = 120.0


def _count(model: torch.nn.Module) -> tuple[int, int]:
    """(routed-expert parameters, all other parameters)."""
    routed = sum(p.numel() for m in model.modules() if isinstance(m, FusedMoE)
                 for p in m.parameters(recurse=False))
    return routed, sum(p.numel() for p in model.parameters()) - routed


def _load_on_rank(rank: int, world_size: int, path: str) -> tuple[int, int, int, list[int]]:
    hf_config = loader.load_hf_config(path)
    ep = ExpertParallelContext(rank, world_size, dist.group.WORLD, "all2all", None, 64)
    read: list[str] = []
    original = loader.iterate_weights

    def counting(p, skip=None):
        for name, tensor in original(p, skip):
            read.append(name)
            yield name, tensor

    loader.iterate_weights = counting  # this rank's process only
    model = loader.build_model(hf_config, path, torch.float32, ep)
    experts_read = sorted({int(n.split(".experts.")[1].split(".")[0])
                           for n in read if ".experts." in n and "shared" not in n})
    routed, other = _count(model)
    return routed, other, len(read), experts_read


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_holds_and_reads_one_ep_share(arch, world_size, tmp_path):
    path = resolve_preset(TINY_MODELS[arch], cache_dir=str(tmp_path))
    full = loader.build_model(loader.load_hf_config(path), path, torch.float32)
    full_routed, full_other = _count(full)
    num_experts = next(m for m in full.modules() if isinstance(m, FusedMoE)).num_experts
    per_rank = num_experts // world_size

    results = run_ranks(_load_on_rank, world_size, path, timeout_s=TIMEOUT_S)
    for rank, (routed, other, _, experts_read) in enumerate(results):
        assert routed * world_size == full_routed
        assert other == full_other  # attention, dense and shared experts are replicated
        assert experts_read == list(range(rank * per_rank, (rank + 1) * per_rank))
    # Every rank read the same number of tensors, fewer than the whole checkpoint.
    assert len({r[2] for r in results}) == 1
