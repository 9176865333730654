"""``widellm serve --config FILE.yaml`` (vLLM's): a YAML mapping of flag names (dashes or
underscores, ``model`` for the positional model) to values. The file's values become the
parser's defaults, so a flag given on the command line wins over the file, and the file wins
over the built-in defaults."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

import yaml

MODEL_KEY = "model"
CONFIG_KEY = "config"
# Flags a file cannot set: they act at parse time (help) or would nest files.
NOT_IN_FILE = {"help", CONFIG_KEY}


def _long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings
            if option.startswith("--") and not option.startswith("--no-")}


def _tokens(flag: str, action: argparse.Action, value: Any) -> list[str]:
    """The command-line words that give ``flag`` the file's ``value``."""
    if value is None:
        raise ValueError(f"{flag}: no value in the config file")
    if action.nargs == 0 and not isinstance(value, bool):
        raise ValueError(f"{flag}: true or false in the config file, got {value!r}")
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # store_true: true gives the flag, false leaves the default off
        return [flag] if value else []
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [flag, *(str(v) for v in value)]
    if isinstance(value, (list, dict, bool)):  # the JSON-valued flags take JSON text
        return [f"{flag}={json.dumps(value)}"]
    return [f"{flag}={value}"]  # '=': a value starting with '-' stays a value


def config_file_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The parsed values the YAML file at ``path`` gives, by argparse dest; ValueError for a
    file that cannot be read, is not a mapping, or names a flag ``parser`` does not have."""
    try:
        with open(path, encoding="utf-8") as f:
            content = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read it: {e}") from None
    if content is None:
        return {}
    if not isinstance(content, Mapping):
        raise ValueError(f"--config {path}: must be a YAML mapping of flag names to values")
    options = _long_options(parser)
    defaults: dict[str, Any] = {}
    tokens: list[str] = []
    dests: list[str] = []
    for key, value in content.items():
        name = str(key).replace("_", "-")
        if name == MODEL_KEY:
            if not isinstance(value, str):
                raise ValueError(f"--config {path}: model must be a string, got {value!r}")
            defaults[MODEL_KEY] = value
            continue
        action = options.get("--" + name)
        if action is None or action.dest in NOT_IN_FILE:
            raise ValueError(f"--config {path}: unknown flag {key!r}")
        tokens += _tokens("--" + name, action, value)
        dests.append(action.dest)
    # The flags' own types, choices and checks apply to the file's values too.
    parsed = parser.parse_args(tokens)
    defaults.update({dest: getattr(parsed, dest) for dest in dests})
    return defaults


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Make the file's values ``parser``'s defaults (argparse's error, exit 2, if it is bad)."""
    try:
        parser.set_defaults(**config_file_defaults(parser, path))
    except ValueError as e:
        parser.error(str(e))
