"""ModelShape: parameter counts, attention FLOPs per pair and KV bytes against hand counts
and the models' published sizes."""

import pytest
from tests.sim.sim_configs import DEEPSEEK_V3, DEEPSEEK_V3_SMALL, LLAMA3_8B, QWEN3_30B_A3B

from widellm.sim.model_shape import ModelShape


def test_deepseek_v3_counts_by_hand():
    s = ModelShape.from_hf_config(DEEPSEEK_V3)
    assert s.family == "deepseek_mla"
    assert (s.num_layers, s.num_moe_layers, s.num_dense_layers) == (61, 58, 3)
    q = 7168 * 1536 + 1536 * 128 * (128 + 64)
    kv_a = 7168 * (512 + 64)
    kv_b = 512 * 128 * (128 + 128)
    o = 128 * 128 * 7168
    assert s.attn_proj_params == q + kv_a + kv_b + o
    assert s.kv_b_params == s.attn_bf16_params == kv_b
    assert s.expert_params == 3 * 7168 * 2048
    assert s.shared_expert_params == 3 * 7168 * 2048
    assert s.dense_mlp_params == 3 * 7168 * 18432
    assert s.flops_per_pair_decode == 2 * 128 * 576 + 2 * 128 * 512
    assert s.flops_per_pair_prefill == 2 * 128 * 192 + 2 * 128 * 128
    # MLA caches 576 values per token per layer: 70,272 bytes per token in bf16.
    assert s.kv_bytes_per_token("bf16") == 576 * 2 * 61 == 70272


def test_deepseek_v3_active_params_match_published_37b():
    s = ModelShape.from_hf_config(DEEPSEEK_V3)
    embedding = 7168 * 129280
    # DeepSeek-V3 technical report: 37B activated parameters per token.
    assert s.active_params_per_token() + embedding == pytest.approx(37e9, rel=0.03)


def test_llama3_8b():
    s = ModelShape.from_hf_config(LLAMA3_8B)
    assert s.family == "dense_gqa" and s.num_moe_layers == 0
    assert s.attn_proj_params == 4096 * (32 + 16) * 128 + 4096 * 4096
    assert s.kv_bytes_per_token("bf16") == 2 * 8 * 128 * 2 * 32  # 128 KiB
    total = s.active_params_per_token() + 4096 * 128256
    assert total == pytest.approx(8.03e9, rel=0.01)


def test_qwen3_moe_active_params():
    s = ModelShape.from_hf_config(QWEN3_30B_A3B)
    assert s.family == "moe_gqa" and s.num_moe_layers == 48 and s.top_k == 8
    assert s.expert_params == 3 * 2048 * 768 and s.shared_expert_params == 0
    total = s.active_params_per_token() + 2048 * 151936
    assert total == pytest.approx(3.3e9, rel=0.03)  # "A3B": 3.3B activated


def test_small_preset_reads_from_object_too():
    class Cfg:
        pass

    cfg = Cfg()
    for k, v in DEEPSEEK_V3_SMALL.items():
        setattr(cfg, k, v)
    assert ModelShape.from_hf_config(cfg) == ModelShape.from_hf_config(DEEPSEEK_V3_SMALL)
    s = ModelShape.from_hf_config(DEEPSEEK_V3_SMALL)
    assert (s.num_moe_layers, s.n_routed_experts, s.top_k) == (7, 64, 6)
