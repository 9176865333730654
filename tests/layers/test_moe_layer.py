"""FusedMoE against HF transformers' MoE blocks, expert-parallel splits, and the dispatcher."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from widellm.layers.moe import (
    DISPATCHER_REGISTRY,
    ExpertParamMapping,
    FusedMoE,
    LocalDispatcher,
    local_expert_ids,
    make_dispatcher,
)

HIDDEN = 32
INTER = 16
NUM_TOKENS = 19


@dataclass
class HFCase:
    """An HF MoE block and how a model file would wrap its routed experts in FusedMoE."""

    name: str
    block: nn.Module
    num_experts: int
    top_k: int
    routing: dict
    # Checkpoint projection names (gate, up, down): Mixtral uses w1/w3/w2.
    proj_names: tuple[str, str, str]
    shared: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None


def _qwen2_shared(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)


def _deepseek_shared(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block.shared_experts(x)


def _eager(config: PretrainedConfig) -> PretrainedConfig:
    """Pin HF's experts to their plain per-expert loop, the oracle we compare with."""
    config._experts_implementation = "eager"
    return config


def _randomize(block: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in list(block.parameters()) + list(block.buffers()):
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.2)
    return block.eval()


def _hf_cases() -> list[HFCase]:
    gate_up_down = ("gate_proj", "up_proj", "down_proj")
    softmax = {"scoring_func": "softmax"}
    mixtral = MixtralSparseMoeBlock(
        _eager(
            MixtralConfig(
                hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=8, num_experts_per_tok=2
            )
        )
    )
    qwen2 = Qwen2MoeSparseMoeBlock(
        _eager(
            Qwen2MoeConfig(
                hidden_size=HIDDEN, moe_intermediate_size=INTER, shared_expert_intermediate_size=24,
                num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
            )
        )
    )
    qwen3 = Qwen3MoeSparseMoeBlock(
        _eager(
            Qwen3MoeConfig(
                hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=8, num_experts_per_tok=3,
                norm_topk_prob=True,
            )
        )
    )
    v2_common = dict(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=16, num_experts_per_tok=3,
        n_shared_experts=2, routed_scaling_factor=16.0,
    )
    v2_greedy = DeepseekV2Moe(_eager(DeepseekV2Config(topk_method="greedy", **v2_common)))
    v2_group = DeepseekV2Moe(
        _eager(DeepseekV2Config(topk_method="group_limited_greedy", n_group=4, topk_group=2, **v2_common))
    )
    v3 = DeepseekV3MoE(
        _eager(
            DeepseekV3Config(
                hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=16, num_experts_per_tok=4,
                n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
            )
        )
    )
    v2_routing = {**softmax, "renormalize": False, "routed_scaling_factor": 16.0}
    return [
        HFCase("mixtral", _randomize(mixtral, 1), 8, 2, {**softmax, "renormalize": True},
               ("w1", "w3", "w2"), None),
        HFCase("qwen2moe", _randomize(qwen2, 2), 8, 3, {**softmax, "renormalize": False},
               gate_up_down, _qwen2_shared),
        HFCase("qwen3moe", _randomize(qwen3, 3), 8, 3, {**softmax, "renormalize": True},
               gate_up_down, None),
        HFCase("dsv2_greedy", _randomize(v2_greedy, 4), 16, 3, v2_routing, gate_up_down, _deepseek_shared),
        HFCase("dsv2_group", _randomize(v2_group, 5), 16, 3,
               {**v2_routing, "num_expert_group": 4, "topk_group": 2, "group_score": "max"},
               gate_up_down, _deepseek_shared),
        HFCase("dsv3", _randomize(v3, 6), 16, 4,
               {"scoring_func": "sigmoid", "renormalize": True, "routed_scaling_factor": 2.5,
                "num_expert_group": 4, "topk_group": 2, "group_score": "top2_sum",
                "e_score_correction_bias": v3.gate.e_score_correction_bias},
               gate_up_down, _deepseek_shared),
    ]


def _per_expert_checkpoint(case: HFCase) -> dict[str, torch.Tensor]:
    """The on-disk per-expert tensors of an HF block whose experts are fused in memory.

    transformers 5 keeps ``experts.gate_up_proj [E, 2I, H]`` (gate rows first, as its forward
    ``chunk(2)`` shows) and ``experts.down_proj [E, H, I]``.
    """
    gate_name, up_name, down_name = case.proj_names
    gate_up = case.block.experts.gate_up_proj.detach()
    down = case.block.experts.down_proj.detach()
    ckpt = {}
    for e in range(case.num_experts):
        prefix = f"model.layers.1.mlp.experts.{e}"
        ckpt[f"{prefix}.{gate_name}.weight"] = gate_up[e, :INTER].clone()
        ckpt[f"{prefix}.{up_name}.weight"] = gate_up[e, INTER:].clone()
        ckpt[f"{prefix}.{down_name}.weight"] = down[e].clone()
    return ckpt


def _build_fused(
    case: HFCase, dtype: torch.dtype = torch.float32, expert_map: torch.Tensor | None = None
) -> tuple[FusedMoE, int]:
    """FusedMoE loaded through the checkpoint-name path; returns it and the tensors it took."""
    moe = FusedMoE(
        case.num_experts, case.top_k, HIDDEN, INTER, dtype=dtype, expert_map=expert_map, **case.routing
    )
    loaded = 0
    for name, tensor in _per_expert_checkpoint(case).items():
        ref = FusedMoE.parse_expert_weight_name(name)
        assert ref is not None and name.endswith(ref.weight_name)
        loaded += moe.weight_loader(ref.param_name, tensor, ref.expert_id, ref.shard_id)
    return moe, loaded


def _router_logits(case: HFCase, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden.float(), case.block.gate.weight.float())


def _hidden(seed: int = 7) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", _hf_cases(), ids=lambda c: c.name)
def test_fused_moe_matches_hf_block(case: HFCase):
    hidden = _hidden()
    with torch.no_grad():
        expected = case.block(hidden.unsqueeze(0)).squeeze(0)
        moe, loaded = _build_fused(case)
        out = moe(hidden, _router_logits(case, hidden))
        if case.shared is not None:
            out = out + case.shared(case.block, hidden)
    assert loaded == 3 * case.num_experts
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_expert_parallel_shards_sum_to_full_output():
    """Two ranks, each holding half of the experts in a shuffled local order, add up to one."""
    case = next(c for c in _hf_cases() if c.name == "dsv3")
    hidden = _hidden(8)
    logits = _router_logits(case, hidden)
    rank_of_expert = torch.arange(case.num_experts) % 2
    partial = torch.zeros(NUM_TOKENS, HIDDEN)
    with torch.no_grad():
        full, _ = _build_fused(case)
        for rank in (0, 1):
            owned = (rank_of_expert == rank).nonzero().squeeze(1).flip(0)
            expert_map = torch.full((case.num_experts,), -1, dtype=torch.int64)
            expert_map[owned] = torch.arange(len(owned))
            moe, loaded = _build_fused(case, expert_map=expert_map)
            assert moe.num_local_experts == len(owned) and moe.w13_weight.shape[0] == len(owned)
            assert loaded == 3 * len(owned)
            partial += moe(hidden, logits)
        torch.testing.assert_close(partial, full(hidden, logits), rtol=0, atol=1e-6)


def test_padding_rows_are_zero_and_do_not_disturb_others():
    case = next(c for c in _hf_cases() if c.name == "qwen3moe")
    hidden = _hidden(9)
    hidden[3] = float("nan")  # garbage in a padding row must not leak anywhere
    logits = _router_logits(case, hidden)
    padding = torch.zeros(NUM_TOKENS, dtype=torch.bool)
    padding[[3, NUM_TOKENS - 1]] = True
    with torch.no_grad():
        moe, _ = _build_fused(case)
        padded = moe(hidden, logits, padding_mask=padding)
        clean = moe(hidden[~padding], logits[~padding])
    assert torch.equal(padded[padding], torch.zeros(2, HIDDEN))
    torch.testing.assert_close(padded[~padding], clean, rtol=0, atol=1e-6)


def test_bf16_layer_tracks_fp32():
    case = next(c for c in _hf_cases() if c.name == "dsv2_group")
    hidden = _hidden(10).bfloat16()
    logits = _router_logits(case, hidden)
    with torch.no_grad():
        moe16, _ = _build_fused(case, dtype=torch.bfloat16)
        moe32, _ = _build_fused(case)
        moe32.w13_weight.copy_(moe16.w13_weight.float())
        moe32.w2_weight.copy_(moe16.w2_weight.float())
        out16 = moe16(hidden, logits)
        out32 = moe32(hidden.float(), logits)
    assert out16.dtype == torch.bfloat16
    # bf16 keeps 8 mantissa bits; two rounded GEMMs stay within a few of its ulps.
    torch.testing.assert_close(out16.float(), out32, rtol=2e-2, atol=2e-2)


def test_forward_rejects_dtype_mismatch():
    case = next(c for c in _hf_cases() if c.name == "mixtral")
    moe, _ = _build_fused(case, dtype=torch.bfloat16)
    hidden = _hidden()
    with pytest.raises(TypeError):
        moe(hidden, _router_logits(case, hidden))


def test_weight_loader_rejects_bad_inputs():
    moe = FusedMoE(4, 2, HIDDEN, INTER, dtype=torch.float32)
    with pytest.raises(ValueError):
        moe.weight_loader("w13_weight", torch.zeros(INTER, HIDDEN), 0, "w2")
    with pytest.raises(ValueError):
        moe.weight_loader("w2_weight", torch.zeros(INTER, HIDDEN), 0, "w2")
    with pytest.raises(ValueError):
        moe.weight_loader("w13_weight", torch.zeros(INTER, HIDDEN), 4, "w1")


def test_weight_loader_places_shards():
    expert_map = torch.tensor([-1, 1, 0], dtype=torch.int64)
    moe = FusedMoE(3, 1, HIDDEN, INTER, dtype=torch.float32, expert_map=expert_map)
    gate, up, down = torch.randn(INTER, HIDDEN), torch.randn(INTER, HIDDEN), torch.randn(HIDDEN, INTER)
    assert moe.weight_loader("w13_weight", gate, 1, "w1")
    assert moe.weight_loader("w13_weight", up, 1, "w3")
    assert moe.weight_loader("w2_weight", down, 1, "w2")
    assert not moe.weight_loader("w2_weight", down, 0, "w2")
    assert torch.equal(moe.w13_weight[1, :INTER], gate)
    assert torch.equal(moe.w13_weight[1, INTER:], up)
    assert torch.equal(moe.w2_weight[1], down)


def test_expert_weight_names():
    parse = FusedMoE.parse_expert_weight_name
    assert parse("model.layers.3.mlp.experts.7.up_proj.weight") == ExpertParamMapping(
        "w13_weight", "experts.7.up_proj.weight", 7, "w3"
    )
    assert parse("model.layers.0.block_sparse_moe.experts.12.w2.weight") == ExpertParamMapping(
        "w2_weight", "experts.12.w2.weight", 12, "w2"
    )
    assert parse("experts.0.gate_proj.weight") == ExpertParamMapping(
        "w13_weight", "experts.0.gate_proj.weight", 0, "w1"
    )
    for other in (
        "model.layers.3.mlp.shared_experts.gate_proj.weight",
        "model.layers.3.mlp.shared_experts.0.gate_proj.weight",
        "model.layers.3.mlp.gate.weight",
        "model.layers.3.mlp.experts.7.up_proj.weight_scale_inv",
    ):
        assert parse(other) is None

    mapping = FusedMoE.make_expert_params_mapping(2, "w1", "w3", "w2")
    assert mapping == [
        ExpertParamMapping("w13_weight", "experts.0.w1.weight", 0, "w1"),
        ExpertParamMapping("w13_weight", "experts.0.w3.weight", 0, "w3"),
        ExpertParamMapping("w2_weight", "experts.0.w2.weight", 0, "w2"),
        ExpertParamMapping("w13_weight", "experts.1.w1.weight", 1, "w1"),
        ExpertParamMapping("w13_weight", "experts.1.w3.weight", 1, "w3"),
        ExpertParamMapping("w2_weight", "experts.1.w2.weight", 1, "w2"),
    ]
    assert all(parse(m.weight_name) == m for m in FusedMoE.make_expert_params_mapping(3))


def test_local_dispatcher_roundtrip_with_padding():
    """Identity experts: combine must give sum_j w_j * h_t, zero for padded slots and rows."""
    num_tokens, top_k, num_experts = 6, 3, 5
    gen = torch.Generator().manual_seed(12)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    topk_ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    topk_ids[2] = -1  # a whole padding row
    topk_weights[2] = float("nan")  # whose weights are garbage
    topk_ids[4, 1] = -1  # one padded slot

    dispatcher = make_dispatcher("local", torch.arange(num_experts))
    handle = dispatcher.dispatch_launch(hidden, topk_ids, topk_weights)
    tokens = dispatcher.dispatch_wait(handle)
    assert tokens.hidden_states.shape == (num_tokens * top_k, HIDDEN)
    assert torch.equal(tokens.hidden_states, hidden.repeat_interleave(top_k, dim=0))
    assert torch.equal(tokens.expert_ids, topk_ids.reshape(-1))

    skipped = (tokens.expert_ids < 0).unsqueeze(1)
    identity_out = tokens.hidden_states.masked_fill(skipped, 0.0)
    out = dispatcher.combine_wait(dispatcher.combine_launch(identity_out, handle))

    valid_weights = topk_weights.masked_fill(topk_ids < 0, 0.0)
    expected = valid_weights.sum(dim=-1, keepdim=True) * hidden
    assert torch.equal(out[2], torch.zeros(HIDDEN))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_local_expert_ids_and_registry():
    expert_map = torch.tensor([2, -1, 0, -1, 1], dtype=torch.int64)
    topk_ids = torch.tensor([[0, 1], [4, -1], [3, 2]])
    assert local_expert_ids(topk_ids, expert_map).tolist() == [[2, -1], [1, -1], [-1, 0]]

    dispatcher = make_dispatcher("local", expert_map)
    assert isinstance(dispatcher, LocalDispatcher)
    assert dispatcher.num_local_experts == 3 and dispatcher.num_global_experts == 5
    assert DISPATCHER_REGISTRY["local"] is LocalDispatcher
    with pytest.raises(ValueError):
        make_dispatcher("nccl_magic", expert_map)
    with pytest.raises(ValueError):
        make_dispatcher("local", torch.tensor([0, 2], dtype=torch.int64))  # local ids not 0..n-1
    with pytest.raises(ValueError):
        make_dispatcher("local", torch.tensor([0, 1], dtype=torch.int32))
