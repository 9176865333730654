"""Skewed-router presets: unbalanced expert load that expert-parallel load balancing can fix."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from widellm.layers.moe.router import select_experts
from widellm.model import preset_writer, presets
from widellm.model.preset_writer import skew_heat, write_checkpoint
from widellm.model.presets import PRESETS, resolve_preset

SKEWED = "deepseek-v3-tiny-skewed"
TWIN = "deepseek-v3-tiny"
EP_SIZES = (2, 4)
NUM_PROMPTS = 16
PROMPT_LEN = 64
PROMPT_SEED = 0
# Balancedness = mean / max of the tokens per EP rank (1.0: even). The skewed preset must be
# clearly unbalanced under contiguous placement over 2 and 4 ranks in every MoE layer.
SKEWED_MAX_BALANCEDNESS = 0.6
# A replica-based balancer must be able to fix it: no single expert dominates.
MAX_HOTTEST_SHARE = 0.5
# The random twin is not perfectly even either (its own random score bias and correlated
# hidden states already skew it a little), but far less than the skewed preset.
TWIN_MIN_EP2_BALANCEDNESS = 0.6
MIN_BALANCEDNESS_GAP = 0.1
BIAS_SUFFIX = "e_score_correction_bias"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("skewed-preset-cache"))


def _expert_counts(name: str, cache_dir: str) -> dict[int, torch.Tensor]:
    """Routed-expert selection counts per MoE layer on random-token prompts.

    Captures each gate's input in the transformers model and routes it the way
    widellm/model/deepseek.py configures select_experts for DeepSeek-V3 (noaux_tc).
    """
    folder = resolve_preset(f"preset:{name}", cache_dir=cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = model.config
    counts: dict[int, torch.Tensor] = {}

    def make_hook(layer: int):
        def hook(gate: torch.nn.Module, args: tuple) -> None:
            x = args[0].reshape(-1, cfg.hidden_size)
            logits = F.linear(x.float(), gate.weight.float())
            _, ids = select_experts(
                logits,
                cfg.num_experts_per_tok,
                scoring_func="sigmoid",
                renormalize=bool(cfg.norm_topk_prob),
                num_expert_group=cfg.n_group,
                topk_group=cfg.topk_group,
                group_score="top2_sum",
                e_score_correction_bias=gate.e_score_correction_bias,
                routed_scaling_factor=cfg.routed_scaling_factor,
            )
            counts[layer] = torch.bincount(ids.flatten(), minlength=cfg.n_routed_experts)

        return hook

    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.register_forward_pre_hook(make_hook(i))
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    # Skip the special ids 0..2 so prompts are ordinary tokens.
    ids = torch.randint(3, cfg.vocab_size, (NUM_PROMPTS, PROMPT_LEN), generator=generator)
    with torch.no_grad():
        model(ids)
    assert sorted(counts) == [1, 2]  # layer 0 is dense
    return counts


def _balancedness(counts: torch.Tensor, ep_size: int) -> float:
    """Mean over max of the tokens per rank, experts split contiguously over ep_size ranks."""
    per_rank = counts.view(ep_size, -1).sum(dim=1).float()
    return float(per_rank.mean() / per_rank.max())


@pytest.fixture(scope="module")
def skewed_counts(cache_dir: str) -> dict[int, torch.Tensor]:
    return _expert_counts(SKEWED, cache_dir)


@pytest.fixture(scope="module")
def twin_counts(cache_dir: str) -> dict[int, torch.Tensor]:
    return _expert_counts(TWIN, cache_dir)


def test_skewed_preset_is_unbalanced_over_contiguous_ep_ranks(skewed_counts):
    for layer, counts in skewed_counts.items():
        for ep_size in EP_SIZES:
            balancedness = _balancedness(counts, ep_size)
            assert balancedness < SKEWED_MAX_BALANCEDNESS, (layer, ep_size, counts.tolist())


def test_skewed_load_is_spread_over_several_hot_experts(skewed_counts):
    num_tokens = NUM_PROMPTS * PROMPT_LEN
    for layer, counts in skewed_counts.items():
        total = counts.sum()
        assert float(counts.max() / total) < MAX_HOTTEST_SHARE, (layer, counts.tolist())
        # No expert is chosen by every token, and the overloaded first EP4 rank owes its
        # load to several experts, so moving or replicating experts can even it out.
        assert int(counts.max()) < num_tokens, (layer, counts.tolist())
        first_rank = counts.view(max(EP_SIZES), -1)[0]
        assert float(first_rank.max() / first_rank.sum()) < MAX_HOTTEST_SHARE, layer


def test_unskewed_twin_is_clearly_better_balanced(skewed_counts, twin_counts):
    for layer, twin in twin_counts.items():
        assert _balancedness(twin, 2) > TWIN_MIN_EP2_BALANCEDNESS, (layer, twin.tolist())
        for ep_size in EP_SIZES:
            gap = _balancedness(twin, ep_size) - _balancedness(skewed_counts[layer], ep_size)
            assert gap > MIN_BALANCEDNESS_GAP, (layer, ep_size)


def test_skewed_preset_differs_from_its_twin_only_in_the_score_bias(cache_dir):
    assert PRESETS[SKEWED].config_kwargs == PRESETS[TWIN].config_kwargs
    assert PRESETS[SKEWED].router_skew > 0 and PRESETS[TWIN].router_skew == 0
    skewed = load_file(os.path.join(resolve_preset(SKEWED, cache_dir), "model.safetensors"))
    twin = load_file(os.path.join(resolve_preset(TWIN, cache_dir), "model.safetensors"))
    assert skewed.keys() == twin.keys()
    hot_sets = []
    for key, value in skewed.items():
        if key.endswith(BIAS_SUFFIX):
            assert value.dtype == torch.float32
            assert not torch.equal(value, twin[key]), key
            added = value - twin[key]
            # Warm first half, nothing on the second half.
            half = added.numel() // 2
            assert bool((added[:half] > 0).all()) and bool((added[half:] == 0).all()), key
            hot_sets.append(set(added.topk(2).indices.tolist()))
        else:
            assert torch.equal(value, twin[key]), key
    # The hot experts move between layers (seeded, so always the same way).
    assert len(hot_sets) == 2 and hot_sets[0] != hot_sets[1]


def test_skew_heat_layout():
    generator = torch.Generator().manual_seed(0)
    num_experts, top_k = 64, 6
    heat = skew_heat(num_experts, top_k, generator)
    quarter, half = num_experts // 4, num_experts // 2
    warm_block = preset_writer.SKEW_WARM + preset_writer.SKEW_BLOCK
    assert bool((heat[half:] == 0).all())
    assert bool((heat[quarter:half] == preset_writer.SKEW_WARM).all())
    hot = heat[:quarter] > warm_block
    assert int(hot.sum()) == top_k // 2
    assert bool((heat[:quarter][~hot] == warm_block).all())
    assert torch.allclose(heat[:quarter][hot], torch.tensor(warm_block + preset_writer.SKEW_HOT))


def test_router_skew_keeps_unskewed_hashes_and_changes_skewed_ones():
    twin = PRESETS[TWIN]
    assert "router_skew" not in twin.to_json_dict()
    assert presets.spec_hash(dataclasses.replace(twin, router_skew=0.0)) == presets.spec_hash(twin)
    skewed = PRESETS[SKEWED]
    assert presets.spec_hash(skewed) != presets.spec_hash(twin)
    assert presets.spec_hash(dataclasses.replace(skewed, router_skew=1.0)) != presets.spec_hash(
        skewed
    )


def test_router_skew_needs_a_score_correction_bias(tmp_path):
    spec = dataclasses.replace(PRESETS["llama-tiny"], router_skew=1.0)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        write_checkpoint(spec, str(tmp_path))


def test_skewed_presets_are_described():
    for name in ("deepseek-v3-tiny", "deepseek-v3-small"):
        assert f"{name}-skewed" in PRESETS[name].description
        skewed = PRESETS[f"{name}-skewed"]
        assert "skewed router" in skewed.description
        assert skewed.config_kwargs == PRESETS[name].config_kwargs
        assert (skewed.seed, skewed.dtype) == (PRESETS[name].seed, PRESETS[name].dtype)
