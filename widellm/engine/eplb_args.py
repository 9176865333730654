"""``--eplb-config`` (vLLM's JSON form of the EPLB settings) next to the flat ``--eplb-*``
flags widellm had first, which stay as aliases: both forms resolve here into one EPLBConfig."""

from __future__ import annotations

import argparse
import numbers
from collections.abc import Mapping
from typing import Any

from widellm.config import EPLBConfig
from widellm.json_flags import parse_json_object

FLAG = "eplb_config"
# --eplb-config key -> (the flat EngineArgs field it aliases, or None for a key with no flat
# flag; the value's kind). All are vLLM's keys but min_balancedness_gain, widellm's own (vLLM
# has no such threshold).
EPLB_CONFIG_KEYS: dict[str, tuple[str | None, type]] = {
    "window_size": ("eplb_window_size", int),
    "step_interval": ("eplb_step_interval", int),
    "num_redundant_experts": ("eplb_num_redundant_experts", int),
    "log_balancedness": ("eplb_log_balancedness", bool),
    "min_balancedness_gain": ("eplb_min_balancedness_gain", float),
    # Offline EPLB (see widellm/eplb/config.py).
    "load_path": (None, str),
    "save_path": (None, str),
    "static": (None, bool),
}
EPLB_CONFIG_HELP = (
    'expert-parallel load balancing settings as JSON (vLLM\'s): {"window_size": 1000, '
    '"step_interval": 3000, "num_redundant_experts": 0, "log_balancedness": false} (and '
    'widellm\'s "min_balancedness_gain": 0.05); offline EPLB: "save_path" keeps this run\'s '
    'measured load in a file, "load_path" places the experts by such a file before the first '
    'step, "static": true never re-plans while serving. The flat --eplb-* flags are aliases '
    "of its keys, and giving one with a different value than its key here is an error")


def _check_kind(key: str, value: Any, kind: type) -> None:
    # bool is an int to Python; JSON's true must not pass for a window of 1 step (nor 1 for
    # true), so each kind is checked exactly.
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is str:
        ok = isinstance(value, str) and value != ""
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{FLAG}: {key} must be a JSON {kind.__name__}, got {value!r}")


def parse_eplb_config(value: str | Mapping[str, Any]) -> dict[str, Any]:
    """The JSON text or dict as a checked dict: known keys only, each of its kind."""
    parsed = parse_json_object(value, FLAG, known=EPLB_CONFIG_KEYS)
    for key, item in parsed.items():
        _check_kind(key, item, EPLB_CONFIG_KEYS[key][1])
    return parsed


def eplb_config_arg(text: str) -> dict[str, Any]:
    """argparse ``type`` of --eplb-config: a bad value is argparse's error (exit 2) naming
    the key, before anything loads."""
    try:
        return parse_eplb_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def resolve_eplb_config(enable_eplb: bool, eplb_config: str | Mapping[str, Any] | None,
                        flat: Mapping[str, Any], flat_defaults: Mapping[str, Any]) -> EPLBConfig:
    """One EPLBConfig from --eplb-config and the flat flags (``flat``: their values by field
    name; ``flat_defaults``: the values they have when not given). A flat flag still at its
    default yields to the JSON key; set to something else, it must agree with the key."""
    settings = parse_eplb_config(eplb_config) if eplb_config is not None else {}
    values = {}
    for key, (field_name, _) in EPLB_CONFIG_KEYS.items():
        if field_name is None:
            if key in settings:
                values[key] = settings[key]
            continue
        value = flat[field_name]
        if key in settings:
            if value != flat_defaults[field_name] and value != settings[key]:
                flag = "--" + field_name.replace("_", "-")
                raise ValueError(f"{FLAG}: {key}={settings[key]!r} contradicts {flag} "
                                 f"{value!r}; give one of them")
            value = settings[key]
        values[key] = value
    return EPLBConfig(enable_eplb=enable_eplb, **values)
