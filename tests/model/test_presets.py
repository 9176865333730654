"""Tests for widellm.model.presets: deterministic random checkpoints loadable by transformers."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from widellm.model import preset_tokenizer, preset_writer, presets
from widellm.model.flops import flops_per_token
from widellm.model.presets import PRESETS, is_preset, preset_flops_per_token, resolve_preset

TINY_PRESETS = sorted(name for name in PRESETS if name.endswith("-tiny"))
ROUND_TRIP_TEXT = "Hello, wide experts! Ünïcödé → 東京 ✓ tabs\tand\nnewlines  ok."
# Hand-computed matmul weights per token of deepseek-v3-tiny (see test below), times 2.
DEEPSEEK_V3_TINY_FLOPS = 432_128.0


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One cache shared by the module so each tiny preset is generated once."""
    return str(tmp_path_factory.mktemp("preset-cache"))


def _file_bytes(folder: str) -> dict[str, bytes]:
    """Every file of a folder by name."""
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


def _active_matmul_params(model: torch.nn.Module, config) -> float:
    """Count per-token matmul weights from the built model, independently of the formula.

    Routed experts are stored fused (one 3-D tensor per projection), so each token touches
    top_k / num_experts of them; the lm_head is counted even when tied to the embeddings.
    """
    num_experts = (
        getattr(config, "n_routed_experts", None)
        or getattr(config, "num_local_experts", None)
        or getattr(config, "num_experts", None)
    )
    total = 0.0
    names = set()
    for name, param in model.named_parameters():
        names.add(name)
        if "embed_tokens" in name or param.ndim < 2:
            continue
        if ".experts." in name:
            total += param.numel() * config.num_experts_per_tok / num_experts
        else:
            total += param.numel()
    if "lm_head.weight" not in names:
        total += config.vocab_size * config.hidden_size
    return total


def test_is_preset():
    assert is_preset("preset:deepseek-v3-tiny")
    assert is_preset("preset:not-a-real-one")
    assert not is_preset("deepseek-v3-tiny")
    assert not is_preset("/models/deepseek-v3-tiny")


def test_unknown_preset_raises(tmp_path):
    with pytest.raises(KeyError, match="deepseek-v3-tiny"):
        resolve_preset("preset:does-not-exist", cache_dir=str(tmp_path))


def test_same_name_gives_same_folder_and_identical_files(tmp_path):
    first = resolve_preset("preset:deepseek-v3-tiny", cache_dir=str(tmp_path / "a"))
    second = resolve_preset("preset:deepseek-v3-tiny", cache_dir=str(tmp_path / "b"))
    assert os.path.basename(first) == os.path.basename(second)
    assert os.path.basename(first).startswith("deepseek-v3-tiny-")
    assert _file_bytes(first) == _file_bytes(second)
    tensors_a = load_file(os.path.join(first, "model.safetensors"))
    tensors_b = load_file(os.path.join(second, "model.safetensors"))
    assert tensors_a.keys() == tensors_b.keys()
    for key, value in tensors_a.items():
        assert torch.equal(value, tensors_b[key]), key
    # A second call reuses the folder instead of regenerating it.
    mtime = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
    assert resolve_preset("deepseek-v3-tiny", cache_dir=str(tmp_path / "a")) == first
    assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == mtime
    # No temporary folders are left behind.
    assert os.listdir(os.path.dirname(first)) == [os.path.basename(first)]


def test_generation_leaves_caller_rng_untouched(tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    resolve_preset("preset:llama-tiny", cache_dir=str(tmp_path))
    assert torch.equal(torch.rand(4), expected)


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(presets.CACHE_DIR_ENV, str(tmp_path))
    folder = resolve_preset("preset:qwen2-tiny")
    assert os.path.dirname(folder) == os.path.join(str(tmp_path), presets.PRESETS_SUBDIR)


def test_lost_race_keeps_the_winners_folder(tmp_path, monkeypatch):
    """If another process renames its folder into place first, ours is dropped cleanly."""
    spec = PRESETS["llama-tiny"]
    final = os.path.join(
        str(tmp_path), presets.PRESETS_SUBDIR, f"llama-tiny-{presets.spec_hash(spec)}"
    )
    real_write = presets.write_checkpoint

    def write_then_lose(spec_arg, folder):
        real_write(spec_arg, folder)
        os.makedirs(os.path.join(final, "winner"))

    monkeypatch.setattr(presets, "write_checkpoint", write_then_lose)
    assert resolve_preset("preset:llama-tiny", cache_dir=str(tmp_path)) == final
    assert os.listdir(final) == ["winner"]
    assert os.listdir(os.path.dirname(final)) == [os.path.basename(final)]


def test_deepseek_v3_config_json_has_routing_fields_and_bias(cache_dir):
    folder = resolve_preset("preset:deepseek-v3-tiny", cache_dir=cache_dir)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    assert raw["topk_method"] == "noaux_tc"
    assert raw["scoring_func"] == "sigmoid"
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == "deepseek_v3"
    assert (config.topk_method, config.scoring_func) == ("noaux_tc", "sigmoid")
    assert (config.n_routed_experts, config.num_experts_per_tok) == (16, 4)
    assert (config.n_group, config.topk_group, config.first_k_dense_replace) == (4, 2, 1)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    biases = [k for k in tensors if k.endswith("e_score_correction_bias")]
    # Layer 0 is dense; layers 1 and 2 are MoE.
    assert sorted(biases) == [
        f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)
    ]
    for key in biases:
        bias = tensors[key]
        assert bias.dtype == torch.float32
        assert bias.shape == (16,)
        assert bool((bias != 0).all())
        assert float(bias.abs().max()) < 10 * preset_writer.SCORE_BIAS_STD


def test_deepseek_v2_tiny_routing(cache_dir):
    config = AutoConfig.from_pretrained(resolve_preset("preset:deepseek-v2-tiny", cache_dir))
    assert config.model_type == "deepseek_v2"
    assert config.q_lora_rank is None
    assert (config.topk_method, config.scoring_func) == ("group_limited_greedy", "softmax")


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_preset_loads_with_transformers(name, cache_dir):
    spec = PRESETS[name]
    folder = resolve_preset(f"preset:{name}", cache_dir=cache_dir)
    config = AutoConfig.from_pretrained(folder)
    assert config.vocab_size == spec.vocab_size
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, 2)

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == spec.vocab_size
    assert tokenizer.eos_token_id == config.eos_token_id
    assert tokenizer.pad_token_id == config.pad_token_id
    ids = tokenizer.encode(ROUND_TRIP_TEXT, add_special_tokens=False)
    assert max(ids) < spec.vocab_size
    assert tokenizer.decode(ids) == ROUND_TRIP_TEXT
    # Random models sample any id, so every id must decode.
    assert isinstance(tokenizer.decode(list(range(spec.vocab_size))), str)

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.tie_word_embeddings == (name == "llama-tiny")
    assert flops_per_token(config) == 2 * _active_matmul_params(model, config)


def test_flops_per_token_deepseek_v3_tiny_exact(cache_dir):
    # attention 3 x (64*48 + 48*4*48 + 64*48 + 32*4*64 + 4*32*64) = 95232
    # dense MLP 3*64*128 = 24576; MoE 2 x (64*16 + (4+1)*3*64*32) = 63488; lm_head 64*512
    config = AutoConfig.from_pretrained(resolve_preset("preset:deepseek-v3-tiny", cache_dir))
    assert flops_per_token(config) == DEEPSEEK_V3_TINY_FLOPS


def test_deepseek_v3_small_flops_and_description():
    flops = preset_flops_per_token("preset:deepseek-v3-small")
    assert 0.3e9 <= flops <= 1.0e9
    assert f"{flops / presets.GIGA:.2f} GFLOP/token" in PRESETS["deepseek-v3-small"].description
    spec = PRESETS["deepseek-v3-small"]
    kwargs = spec.config_kwargs
    assert (kwargs["kv_lora_rank"], kwargs["qk_rope_head_dim"]) == (512, 64)
    assert (kwargs["qk_nope_head_dim"], kwargs["v_head_dim"]) == (128, 128)
    assert spec.extra_config == {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def test_build_tokenizer_pads_with_fillers():
    tokenizer = preset_tokenizer.build_tokenizer(4000)
    assert len(tokenizer) == 4000
    assert tokenizer.convert_ids_to_tokens(3999).startswith("<filler")
    assert tokenizer.decode([3999]) == tokenizer.convert_ids_to_tokens(3999)
    with pytest.raises(ValueError):
        preset_tokenizer.build_tokenizer(100)
