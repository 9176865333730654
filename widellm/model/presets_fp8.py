"""FP8 presets: a saved preset checkpoint rewritten into DeepSeek-V3's own FP8 format.

``preset:deepseek-v3-tiny-fp8`` is ``deepseek-v3-tiny`` (same config, seed and fp32 weights)
passed through :func:`quantize_checkpoint`: every linear weight DeepSeek-V3 ships in FP8
becomes a float8_e4m3fn ``X.weight`` plus a float32 ``X.weight_scale_inv`` with one scale per
128 x 128 block (``widellm/model/fp8.py``), and config.json gains DeepSeek's
``quantization_config``. Like DeepSeek's checkpoints, embeddings, norms, the router gate (and
its score-correction bias) and lm_head stay unquantized.

The tiny model's sizes are mostly below 128, so most of its weights are a single partial
block; ``q_b_proj`` (192 rows), ``kv_b_proj`` (256 rows) and the dense MLP (intermediate 128)
have full blocks, more than one block along their rows, or both.
"""

from __future__ import annotations

import json
import os
from typing import Any

from widellm.model.fp8 import (
    WEIGHT_BLOCK_SIZE,
    deepseek_fp8_quantization_config,
    quantize_weight_block_fp8,
)
from widellm.model.fp8_weights import QUANTIZATION_CONFIG_KEY, scale_inv_name

# PresetSpec.quantization value of DeepSeek-V3's block FP8.
QUANTIZATION_FP8 = "fp8"
# Bump when the rewrite changes what a given preset produces.
FP8_PRESET_VERSION = 1
# The linear layers DeepSeek-V3 stores in FP8: MLA projections and the dense, shared and
# routed expert MLPs (``q_proj`` is DeepSeek-V2-Lite's, which has no q LoRA).
FP8_LINEARS = frozenset({
    "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
    "gate_proj", "up_proj", "down_proj",
})
WEIGHT_SUFFIX = ".weight"
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# transformers refuses safetensors files without this metadata entry.
SAFETENSORS_METADATA = {"format": "pt"}
JSON_INDENT = 2


def is_fp8_linear_weight(name: str) -> bool:
    """Whether DeepSeek-V3 stores checkpoint tensor ``name`` in FP8, e.g. True for
    ``model.layers.1.mlp.experts.3.down_proj.weight``, False for ``model.layers.1.mlp.gate.weight``
    and ``model.layers.0.self_attn.kv_a_layernorm.weight``."""
    if not name.endswith(WEIGHT_SUFFIX):
        return False
    module = name[: -len(WEIGHT_SUFFIX)].rsplit(".", 1)[-1]
    return module in FP8_LINEARS


def quantization_recipe(quantization: str) -> dict[str, Any]:
    """Everything that shapes a quantized preset's files, for the preset cache hash."""
    _check_kind(quantization)
    return {
        "version": FP8_PRESET_VERSION,
        QUANTIZATION_CONFIG_KEY: deepseek_fp8_quantization_config(WEIGHT_BLOCK_SIZE),
        "linears": sorted(FP8_LINEARS),
    }


def quantize_checkpoint(folder: str, quantization: str) -> None:
    """Rewrite the safetensors of a saved checkpoint folder into DeepSeek-V3's FP8 format,
    in place, and add its ``quantization_config`` to config.json.

    Every tensor :func:`is_fp8_linear_weight` selects, [out, in], becomes ``X.weight``
    float8_e4m3fn [out, in] and ``X.weight_scale_inv`` float32 [ceil(out/128),
    ceil(in/128)], written to the same shard; the rest is kept as saved. Works for a single
    ``model.safetensors`` and for sharded checkpoints with an index.
    """
    from safetensors.torch import load_file, save_file

    _check_kind(quantization)
    index_path = os.path.join(folder, SAFETENSORS_INDEX)
    index = _read_json(index_path) if os.path.isfile(index_path) else None
    files = sorted(set(index["weight_map"].values())) if index else [SAFETENSORS_SINGLE]
    quantized = total_bytes = 0
    for file_name in files:
        path = os.path.join(folder, file_name)
        out = {}
        for name, tensor in load_file(path).items():
            if not is_fp8_linear_weight(name):
                out[name] = tensor
                continue
            q, scale_inv = quantize_weight_block_fp8(tensor, WEIGHT_BLOCK_SIZE)
            out[name] = q
            out[scale_inv_name(name)] = scale_inv
            if index:
                index["weight_map"][scale_inv_name(name)] = file_name
            quantized += 1
        total_bytes += sum(t.numel() * t.element_size() for t in out.values())
        save_file(out, path, metadata=SAFETENSORS_METADATA)
    if not quantized:
        raise ValueError(f"{folder}: no DeepSeek FP8 linear weights ({sorted(FP8_LINEARS)})")
    if index:
        index.setdefault("metadata", {})["total_size"] = total_bytes
        _write_json(index_path, index)
    config_path = os.path.join(folder, "config.json")
    config = _read_json(config_path)
    config[QUANTIZATION_CONFIG_KEY] = deepseek_fp8_quantization_config(WEIGHT_BLOCK_SIZE)
    _write_json(config_path, config)


def _check_kind(quantization: str) -> None:
    if quantization != QUANTIZATION_FP8:
        raise ValueError(
            f"preset quantization {quantization!r} is not supported (only {QUANTIZATION_FP8!r})"
        )


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=JSON_INDENT, sort_keys=True)
        f.write("\n")
