"""Finding a model and loading it: preset names, HF folders (config.json + safetensors, single
or sharded with an index) and GGUF files (dequantized on load)."""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from widellm.distributed.ep_context import ExpertParallelContext
from widellm.layers.linear import linear_method_counts, pack_linear_weights, use_fp8_weights
from widellm.layers.moe.experts_fp8 import use_fp8_experts
from widellm.model.fp8_layers import fp8_expert_layer_names, fp8_layer_names, layer_of
from widellm.model.fp8_weights import Fp8BlockQuantConfig, fp8_block_weights, with_scales
from widellm.model.fused_decode import enable_fused_decode
from widellm.model.registry import get_model_class
from widellm.model.weight_utils import (
    expert_module_of, process_weights_after_loading, remote_expert_filter,
)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PRESET_PREFIX = "preset:"

logger = logging.getLogger(__name__)


def resolve_model_path(model: str | None) -> str:
    """None -> the default model; ``preset:NAME`` -> its generated folder; else an existing
    folder or .gguf file. Raises ValueError naming ``model`` otherwise."""
    if model is None:
        from widellm.model.default_model import default_model_path

        return default_model_path()
    if model.startswith(PRESET_PREFIX):
        from widellm.model.presets import PRESETS, resolve_preset

        if model[len(PRESET_PREFIX):] not in PRESETS:
            raise ValueError(f"model {model!r}: unknown preset; known: {', '.join(sorted(PRESETS))}")
        return resolve_preset(model)
    if os.path.isfile(model) and model.endswith(".gguf"):
        return model
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        return model
    raise ValueError(
        f"model {model!r}: not a preset, a .gguf file or a folder with config.json "
        "(no model hub is used)"
    )


def load_hf_config(path: str) -> Any:
    if path.endswith(".gguf"):
        from widellm.model.gguf_loader import load_gguf

        return load_gguf(path).config
    # Imported here: AutoConfig's table of every architecture is ~0.4 s of import that an
    # engine core, which gets its config from the frontend, never needs.
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    # Keys some configs carry that transformers' classes drop (DeepSeek-V3's scoring_func,
    # topk_method): keep them visible to the model code.
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    for key in ("scoring_func", "topk_method"):
        if key in raw and not hasattr(cfg, key):
            setattr(cfg, key, raw[key])
    return cfg


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.isfile(os.path.join(path, SAFETENSORS_SINGLE)):
        return [SAFETENSORS_SINGLE]
    raise ValueError(f"model {path!r}: no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}")


def checkpoint_names(path: str) -> list[str]:
    """Every tensor name of a safetensors checkpoint, without reading a tensor."""
    names: list[str] = []
    for name in _safetensors_files(path):
        with safe_open(os.path.join(path, name), framework="pt") as f:
            names.extend(f.keys())
    return names


def iterate_weights(
    path: str, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs, one tensor in memory at a time. Safetensors names for which
    ``skip`` is true are not read at all (other ranks' experts); GGUF stores each layer's
    experts stacked in one tensor, so there every rank reads them all."""
    if path.endswith(".gguf"):
        from widellm.model.gguf_loader import load_gguf

        yield from load_gguf(path).weights()
        return
    for name in _safetensors_files(path):
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                if skip is None or not skip(key):
                    yield key, f.get_tensor(key)


def build_model(
    hf_config: Any, path: str, dtype: torch.dtype, ep: ExpertParallelContext | None = None,
    device: torch.device | str = "cpu", keep_fp8: bool | None = None, fp8_kernel: str = "auto",
) -> nn.Module:
    """Instantiate the architecture in ``dtype`` on ``device`` (routers stay fp32) and load the
    weights. With ``ep``, MoE models hold and read only this rank's routed experts; dense models
    have nothing to split and ignore it.

    Each ``Linear`` gets its linear method here (layers/linear.py): DeepSeek FP8 checkpoints
    (``quantization_config``) keep their FP8 weights in the linears and routed experts that can
    (``keep_fp8``, default: on CUDA; see fp8_layers.py) and are dequantized to ``dtype`` elsewhere
    (fp8_weights.py); bf16/fp32 plain weights on CPU end up prepacked for oneDNN
    (``$WIDELLM_CPU_PACKED_LINEAR=0`` keeps them plain). ``fp8_kernel`` pins the FP8 layers'
    kernel (tests)."""
    device = torch.device(device)
    cls = get_model_class(hf_config.architectures[0])
    kwargs = {"ep": ep} if ep is not None and "ep" in inspect.signature(cls).parameters else {}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = cls(hf_config, **kwargs)
    finally:
        torch.set_default_dtype(previous)
    fp8 = Fp8BlockQuantConfig.from_hf_config(hf_config)
    kept: set[str] = set()
    kept_experts: set[str] = set()
    if fp8 is not None and (device.type == "cuda" if keep_fp8 is None else keep_fp8):
        names = checkpoint_names(path)
        kept = fp8_layer_names(model, names, fp8.weight_block_size)
        use_fp8_weights(model, kept, fp8.weight_block_size, fp8_kernel)
        kept_experts = fp8_expert_layer_names(model, names, fp8.weight_block_size)
        use_fp8_experts(model, kept_experts, fp8.weight_block_size, fp8_kernel)
    with torch.no_grad():
        if fp8 is None:
            model.load_weights(iterate_weights(path, skip=remote_expert_filter(model)))
        else:
            # DeepSeek FP8: each weight meets its weight_scale_inv and stays FP8 if its layer
            # does; other ranks' experts skip both.
            stacked = getattr(model, "stacked_shards", ())
            weights = iterate_weights(path, skip=with_scales(remote_expert_filter(model)))
            model.load_weights(fp8_block_weights(
                weights, fp8, dtype, keep_fp8=lambda name: (
                    layer_of(name, stacked)[0] in kept or expert_module_of(name) in kept_experts)))
    process_weights_after_loading(model)
    # Last: the hooks above may still read Linear weights; packing frees them.
    pack_linear_weights(model)
    enable_fused_decode(model)  # needs the packed weights
    logger.debug("linear methods: %s", linear_method_counts(model))
    return model.eval()


def load_eos_token_ids(path: str, hf_config: Any) -> list[int]:
    """End-of-sequence ids from generation_config.json (or the GGUF metadata), falling back to
    config.json's ``eos_token_id``."""
    if path.endswith(".gguf"):
        from widellm.model.gguf_loader import load_gguf

        return list(load_gguf(path).generation_eos_token_ids)
    eos = None
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
