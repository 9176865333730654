"""The sampling defaults a model ships in its ``generation_config.json`` (vLLM's
``--generation-config`` and ``--override-generation-config``): a request that leaves
temperature, top_p, top_k, min_p, repetition_penalty or max_tokens unset gets the model
author's value instead of the API's generic one.

``auto`` reads the model's folder, ``vllm`` ignores the file (the API's defaults apply), any
other value is a folder holding a ``generation_config.json``. Overrides apply on top of
either, in the file's own key names (``max_new_tokens``, not ``max_tokens``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from widellm.json_flags import parse_json_object
from widellm.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# vLLM's names for "the model's folder" and "none at all".
GENERATION_CONFIG_AUTO = "auto"
GENERATION_CONFIG_IGNORE = "vllm"
# generation_config.json keys that become sampling defaults -> the SamplingParams field (the
# set vLLM takes; do_sample is not read, as in vLLM: a temperature given is the default).
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _read_file(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    return config


def _parse_override(override: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if override is None:
        return {}
    return parse_json_object(override, "override_generation_config", SAMPLING_KEYS)


def default_sampling_params(generation_config: str, model_path: str,
                            override: str | Mapping[str, Any] | None = None
                            ) -> dict[str, Any]:
    """The defaults, as SamplingParams keyword arguments; checked here, so a value out of
    range fails at start-up rather than in every request."""
    if generation_config == GENERATION_CONFIG_IGNORE:
        config: dict[str, Any] = {}
    elif generation_config == GENERATION_CONFIG_AUTO:
        # A .gguf model carries no generation_config.json (its EOS ids are read elsewhere).
        config = _read_file(model_path) if os.path.isdir(model_path) else {}
    elif os.path.isdir(generation_config):
        config = _read_file(generation_config)
    else:
        raise ValueError(f"generation_config: {generation_config!r} is not "
                         f"{GENERATION_CONFIG_AUTO}, {GENERATION_CONFIG_IGNORE} or a folder")
    config.update(_parse_override(override))
    defaults = {SAMPLING_KEYS[k]: v for k, v in config.items()
                if k in SAMPLING_KEYS and v is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"generation_config: a default is invalid: {e}") from None
    return defaults
