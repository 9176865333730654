"""Architecture name (config.json ``architectures[0]``) -> model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

# name -> (module under widellm.model, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV3ForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"widellm.model.{module}"), name)
