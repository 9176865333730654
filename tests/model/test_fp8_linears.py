"""The FP8 block linear method: which layers of a DeepSeek FP8 checkpoint keep their FP8
weights, a model that keeps them generates exactly what the dequantized model does (fp32, the
``dequant`` kernel), and the W8A8 Triton kernel (in Triton's interpreter) equals its torch
twin."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.model.test_fp8_checkpoint import dequantized_then_kept_runs, make_prompts
from widellm import SamplingParams
from widellm.layers.linear import PACKED_LINEAR_ENV, Linear, use_fp8_weights
from widellm.layers.linear_fp8 import (
    Fp8BlockLinearMethod, dequantize_blocks, w8a8_linear, w8a8_linear_reference,
)
from widellm.model import loader
from widellm.model.fp8 import dequantize_weight_block_fp8, quantize_weight_block_fp8
from widellm.model.fp8_layers import fp8_layer_names
from widellm.model.presets import resolve_preset

FP8_PRESET = "preset:deepseek-v3-tiny-fp8"
BLOCK = (128, 128)
ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory) -> str:
    return resolve_preset(FP8_PRESET, cache_dir=str(tmp_path_factory.mktemp("fp8-linears")))


def _config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def expected_fp8_layers(config: dict) -> set[str]:
    """Spelled out from the config: every attention projection and every down_proj; a
    gate_up_proj only where the up half starts on a 128-row block boundary (its intermediate
    size is a multiple of 128); routed experts never (they are no Linear)."""
    layers = set()
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        layers |= {f"{prefix}.self_attn.{p}" for p in ATTENTION}
        if i < config["first_k_dense_replace"]:
            mlp, width = f"{prefix}.mlp", config["intermediate_size"]
        else:
            mlp = f"{prefix}.mlp.shared_experts"
            width = config["moe_intermediate_size"] * config["n_shared_experts"]
        layers.add(f"{mlp}.down_proj")
        if width % BLOCK[0] == 0:
            layers.add(f"{mlp}.gate_up_proj")
    return layers


def test_fp8_layer_names_follow_the_block_boundaries(fp8_folder, monkeypatch):
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")  # the layers stay plain, as before loading
    config = _config(fp8_folder)
    hf_config = loader.load_hf_config(fp8_folder)
    model = loader.build_model(hf_config, fp8_folder, torch.float32, keep_fp8=False)
    kept = fp8_layer_names(model, loader.checkpoint_names(fp8_folder), BLOCK)
    assert kept == expected_fp8_layers(config)
    # The tiny preset has both cases: the dense MLP (intermediate 128) keeps its gate_up_proj,
    # the shared experts (64 wide) do not.
    assert "model.layers.0.mlp.gate_up_proj" in kept
    assert "model.layers.1.mlp.shared_experts.gate_up_proj" not in kept


def test_kept_fp8_weights_generate_exactly_like_dequantized(fp8_folder, monkeypatch):
    """fp32 with the dequant kernel: the same products as a load-time dequantization, so the
    same tokens and the same logprobs, bit for bit."""
    prompts = make_prompts(_config(fp8_folder)["vocab_size"])
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)

    def kept_linears(model):
        return {n: m.weight.dtype for n, m in model.named_modules()
                if isinstance(m, Linear) and isinstance(m.linear_method, Fp8BlockLinearMethod)}

    (plain_fp8, plain_tokens, plain_lp), (kept_fp8, kept_tokens, kept_lp) = (
        dequantized_then_kept_runs(fp8_folder, prompts, params, monkeypatch, kept_linears))
    assert plain_fp8 == {}  # on CPU FP8 checkpoints are dequantized at load
    assert set(kept_fp8) == expected_fp8_layers(_config(fp8_folder))
    assert set(kept_fp8.values()) == {torch.float8_e4m3fn}
    assert kept_tokens == plain_tokens
    assert kept_lp == plain_lp


def test_dequantize_blocks_is_the_loaders_dequantization():
    torch.manual_seed(0)
    w = torch.randn(200, 300) * 0.05
    q, scale_inv = quantize_weight_block_fp8(w)
    assert torch.equal(dequantize_blocks(q, scale_inv, BLOCK),
                       dequantize_weight_block_fp8(q, scale_inv, torch.float32))


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_kernel_equals_its_twin(rows, bias):
    """The Triton W8A8 path (activation group quantization + block-scaled FP8 GEMM) against
    its torch twin: equal up to the bf16 rounding of the output; both within FP8's activation
    error of the dequant reference. in 256 = 2 groups, out 160 = a full and a partial block."""
    torch.manual_seed(rows)
    layer = Linear(256, 160, bias=bias, dtype=torch.bfloat16)
    w = torch.randn(160, 256) * 0.05
    use_fp8_weights(torch.nn.ModuleDict({"l": layer}), ["l"], BLOCK, kernel="w8a8")
    q, scale_inv = quantize_weight_block_fp8(w)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale_inv.copy_(scale_inv)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    got = w8a8_linear(x, layer.weight, layer.weight_scale_inv)
    twin = w8a8_linear_reference(x, layer.weight, layer.weight_scale_inv)
    assert got.dtype == twin.dtype == torch.bfloat16
    torch.testing.assert_close(got, twin, rtol=2**-7, atol=2**-7 * twin.abs().max().item())
    with torch.no_grad():
        y = layer(x)
        reference = torch.nn.functional.linear(x.float(), dequantize_blocks(q, scale_inv, BLOCK),
                                               None if layer.bias is None else layer.bias.float())
    assert y.shape == (rows, 160) and y.dtype == torch.bfloat16
    # e4m3 keeps 3 mantissa bits: each activation is within 2^-4 of itself, relatively.
    err = (y.float() - reference).abs().max().item()
    assert err <= 2**-4 * reference.abs().max().item()
