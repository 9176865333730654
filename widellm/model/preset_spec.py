"""A preset's recipe: the transformers config and model classes, their arguments, the seed
and what is done to the weights after building (router skew, FP8 rewrite)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class PresetSpec:
    """Recipe for one random-weight model.

    Attributes:
        config_class: name of the transformers config class, e.g. ``"DeepseekV3Config"``.
        model_class: name of the transformers causal-LM class built from that config.
        config_kwargs: keyword arguments for the config class (vocab size included).
        seed: torch seed used before building the model, which fixes every weight.
        dtype: dtype of the saved weights (``"float32"`` or ``"bfloat16"``).
        extra_config: keys merged into config.json after saving, for fields real checkpoints
            carry that the transformers config class drops (e.g. DeepSeek-V3's topk_method).
        description: one line for humans and ``--help`` listings.
        router_skew: 0 (default) for a plain random router; > 0 makes a few experts hot
            through the DeepSeek-V3 score-correction bias (see
            :data:`widellm.model.preset_writer.SKEW_WARM`), in units of the router-score
            spread. DeepSeek-V3 (``e_score_correction_bias``) models only.
        quantization: None (default) for plain weights; ``"fp8"`` rewrites the saved
            checkpoint into DeepSeek-V3's block FP8 format (``presets_fp8.py``).
    """

    config_class: str
    model_class: str
    config_kwargs: Mapping[str, Any]
    seed: int = 0
    dtype: str = "float32"
    extra_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    description: str = ""
    router_skew: float = 0.0
    quantization: str | None = None

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the model and of its generated tokenizer."""
        return int(self.config_kwargs["vocab_size"])

    def to_json_dict(self) -> dict[str, Any]:
        """Plain-dict form used for hashing (and handy for logging)."""
        out = {
            "config_class": self.config_class,
            "model_class": self.model_class,
            "config_kwargs": dict(self.config_kwargs),
            "seed": self.seed,
            "dtype": self.dtype,
            "extra_config": dict(self.extra_config),
        }
        # Only when set, so unskewed presets keep their hashes (and cached folders).
        if self.router_skew:
            out["router_skew"] = self.router_skew
        if self.quantization:
            out["quantization"] = self.quantization
        return out
