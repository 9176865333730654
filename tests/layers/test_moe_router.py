"""select_experts against HF transformers' routers and hand-computed DeepSeek-V3 routing."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from widellm.layers.moe.router import select_experts

HIDDEN = 32
NUM_TOKENS = 64


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order each row's (id, weight) pairs by id: the column order is not part of the contract."""
    sorted_ids, perm = ids.sort(dim=-1)
    return weights.gather(1, perm), sorted_ids


def _random_router(router: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.3)
        if hasattr(router, "e_score_correction_bias"):
            bias = router.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.2)
    return router


def _hf_cases() -> list[tuple[str, torch.nn.Module, dict]]:
    """(name, HF router with random weights, select_experts kwargs a model file would pass)."""
    mixtral = MixtralTopKRouter(
        MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
    )
    qwen2 = Qwen2MoeTopKRouter(
        Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=12, num_experts_per_tok=4, norm_topk_prob=False)
    )
    qwen2_norm = Qwen2MoeTopKRouter(
        Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=12, num_experts_per_tok=4, norm_topk_prob=True)
    )
    qwen3 = Qwen3MoeTopKRouter(
        Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
    )
    v2_common = dict(
        hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3, routed_scaling_factor=16.0
    )
    v2_greedy = DeepseekV2TopkRouter(DeepseekV2Config(topk_method="greedy", **v2_common))
    v2_group = DeepseekV2TopkRouter(
        DeepseekV2Config(topk_method="group_limited_greedy", n_group=4, topk_group=2, **v2_common)
    )
    v3 = DeepseekV3TopkRouter(
        DeepseekV3Config(
            hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
            norm_topk_prob=True, routed_scaling_factor=2.5,
        )
    )
    softmax = {"scoring_func": "softmax"}
    return [
        ("mixtral", _random_router(mixtral, 1), {**softmax, "renormalize": True}),
        ("qwen2moe", _random_router(qwen2, 2), {**softmax, "renormalize": False}),
        ("qwen2moe_norm", _random_router(qwen2_norm, 3), {**softmax, "renormalize": True}),
        ("qwen3moe", _random_router(qwen3, 4), {**softmax, "renormalize": True}),
        ("dsv2_greedy", _random_router(v2_greedy, 5),
         {**softmax, "renormalize": False, "routed_scaling_factor": 16.0}),
        ("dsv2_group", _random_router(v2_group, 6),
         {**softmax, "renormalize": False, "routed_scaling_factor": 16.0,
          "num_expert_group": 4, "topk_group": 2, "group_score": "max"}),
        ("dsv3", _random_router(v3, 7),
         {"scoring_func": "sigmoid", "renormalize": True, "routed_scaling_factor": 2.5,
          "num_expert_group": 4, "topk_group": 2, "group_score": "top2_sum",
          "e_score_correction_bias": v3.e_score_correction_bias}),
    ]


@pytest.mark.parametrize("case", _hf_cases(), ids=lambda c: c[0])
def test_select_experts_matches_hf_router(case):
    _, router, kwargs = case
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts(logits, router.top_k, **kwargs)

    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    hf_weights, hf_ids = _by_expert(hf_weights, hf_ids)
    weights, ids = _by_expert(weights, ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-6)


def test_group_limit_and_bias_change_selection():
    """The group and bias cases above would pass vacuously if those steps never mattered."""
    cases = {name: (router, kw) for name, router, kw in _hf_cases()}
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(11))

    v2_router, v2_kwargs = cases["dsv2_group"]
    logits = v2_router(hidden)[0].detach()
    _, grouped = _by_expert(*select_experts(logits, 3, **v2_kwargs))
    _, greedy = _by_expert(*select_experts(logits, 3, scoring_func="softmax", renormalize=False))
    assert (grouped != greedy).any(dim=-1).sum() > 0

    v3_router, v3_kwargs = cases["dsv3"]
    logits = v3_router(hidden)[0].detach()
    _, biased = _by_expert(*select_experts(logits, 4, **v3_kwargs))
    unbiased_kwargs = {**v3_kwargs, "e_score_correction_bias": None}
    _, unbiased = _by_expert(*select_experts(logits, 4, **unbiased_kwargs))
    assert (biased != unbiased).any(dim=-1).sum() > 0


def test_deepseek_v3_routing_by_hand():
    """4 experts in 2 groups of 2, keep 1 group, top-2, sigmoid scores 0.6, 0.5, 0.9, 0.1.

    Without bias: group sums 1.1 vs 1.0 -> group 0 -> experts {0, 1} although expert 2 is best.
    With bias +0.3 on expert 3: biased group-1 sum 0.9 + 0.4 = 1.3 wins -> experts {2, 3}, whose
    gate values come from the unbiased scores 0.9, 0.1 (sum 1), times the scale 2.5.
    """
    logits = torch.logit(torch.tensor([[0.6, 0.5, 0.9, 0.1]], dtype=torch.float64)).float()
    kwargs = dict(
        scoring_func="sigmoid", num_expert_group=2, topk_group=1, group_score="top2_sum",
    )

    weights, ids = _by_expert(*select_experts(logits, 2, renormalize=False, **kwargs))
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.tensor([[0.6, 0.5]]), rtol=0, atol=1e-6)

    bias = torch.tensor([0.0, 0.0, 0.0, 0.3])
    weights, ids = _by_expert(
        *select_experts(
            logits, 2, renormalize=True, e_score_correction_bias=bias, routed_scaling_factor=2.5, **kwargs
        )
    )
    assert ids.tolist() == [[2, 3]]
    torch.testing.assert_close(weights, torch.tensor([[2.25, 0.25]]), rtol=0, atol=1e-6)


def test_group_max_score_by_hand():
    """DeepSeek-V2 group score is the group max: groups {0,1} max .4, {2,3} max .35 -> group 0."""
    probs = torch.tensor([[0.40, 0.01, 0.35, 0.24]], dtype=torch.float64)
    weights, ids = _by_expert(
        *select_experts(
            probs.log().float(), 2, scoring_func="softmax", renormalize=False,
            num_expert_group=2, topk_group=1, group_score="max", routed_scaling_factor=2.0,
        )
    )
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.tensor([[0.80, 0.02]]), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(scoring_func="relu", renormalize=False),
        dict(scoring_func="softmax", renormalize=False, num_expert_group=3, topk_group=1),
        dict(scoring_func="softmax", renormalize=False, num_expert_group=4, topk_group=None),
        dict(scoring_func="softmax", renormalize=False, num_expert_group=4, topk_group=1),
        dict(scoring_func="sigmoid", renormalize=False, e_score_correction_bias=torch.zeros(7)),
    ],
)
def test_select_experts_rejects_bad_config(kwargs):
    # 8 experts, top-3: 4 groups of 2 keeping 1 group leaves too few experts.
    with pytest.raises(ValueError):
        select_experts(torch.zeros(2, 8), 3, **kwargs)
