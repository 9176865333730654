"""FP8 routed experts kept as loaded: which FusedMoE layers keep them, and a model that keeps
them (fp32, the ``dequant`` kernel) generates exactly what the dequantized model does, tokens
and logprobs bit for bit.

The checkpoint is deepseek-v3-tiny-fp8 with a 128-wide expert MLP, so that up_proj's rows start
on a 128-row block boundary (the preset's own 32 does not, and its experts are dequantized)."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch

from tests.model.test_fp8_checkpoint import dequantized_then_kept_runs, make_prompts
from widellm import SamplingParams
from widellm.layers.moe.experts_fp8 import Fp8BlockExperts, fp8_experts_supported
from widellm.layers.moe.layer import FusedMoE
from widellm.model import loader
from widellm.model.fp8_layers import fp8_expert_layer_names
from widellm.model.preset_writer import write_checkpoint
from widellm.model.presets import get_preset

BLOCK = (128, 128)
EXPERT_WIDTH = 128
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory) -> str:
    spec = get_preset("deepseek-v3-tiny-fp8")
    spec = dataclasses.replace(spec, config_kwargs={**spec.config_kwargs,
                                                    "moe_intermediate_size": EXPERT_WIDTH})
    folder = str(tmp_path_factory.mktemp("fp8-experts"))
    write_checkpoint(spec, folder)
    return folder


def _moe_layers(folder: str) -> set[str]:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return {f"model.layers.{i}.mlp.experts"
            for i in range(config["first_k_dense_replace"], config["num_hidden_layers"])}


def test_every_moe_layer_keeps_fp8_experts_when_blocks_allow(fp8_folder):
    hf_config = loader.load_hf_config(fp8_folder)
    model = loader.build_model(hf_config, fp8_folder, torch.float32, keep_fp8=False)
    names = loader.checkpoint_names(fp8_folder)
    assert fp8_expert_layer_names(model, names, BLOCK) == _moe_layers(fp8_folder)
    # A missing scale keeps the whole layer dequantized.
    dropped = {n for n in names if not n.startswith("model.layers.1.mlp.experts.5.up_proj.weight_")}
    assert fp8_expert_layer_names(model, dropped, BLOCK) == _moe_layers(fp8_folder) - {
        "model.layers.1.mlp.experts"}
    # Up's first row off a block boundary: no. EPLB placement: yes (its moves carry the scales,
    # tests/worker/test_eplb_controller.py).
    assert not fp8_experts_supported(SimpleNamespace(intermediate_size=64, placement=None), BLOCK)
    assert fp8_experts_supported(SimpleNamespace(intermediate_size=128, placement=object()),
                                 BLOCK)


def test_kept_fp8_experts_generate_exactly_like_dequantized(fp8_folder, monkeypatch):
    with open(os.path.join(fp8_folder, "config.json"), encoding="utf-8") as f:
        prompts = make_prompts(json.load(f)["vocab_size"])
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)

    def kept_experts(model):
        return {n: (m.w13_weight.dtype, m.w2_weight.dtype, m.w13_weight_scale_inv.shape[1:])
                for n, m in model.named_modules()
                if isinstance(m, FusedMoE) and isinstance(m.experts_method, Fp8BlockExperts)}

    (plain_kept, plain_tokens, plain_lp), (kept, kept_tokens, kept_lp) = (
        dequantized_then_kept_runs(fp8_folder, prompts, params, monkeypatch, kept_experts))
    assert plain_kept == {}  # on CPU FP8 checkpoints are dequantized at load
    # w13 [E, 2I, H] keeps 2I / 128 = 2 block rows (gate's, then up's) by cdiv(64, 128) = 1.
    fp8 = torch.float8_e4m3fn
    assert kept == {name: (fp8, fp8, (2, 1)) for name in _moe_layers(fp8_folder)}
    assert kept_tokens == plain_tokens
    assert kept_lp == plain_lp
