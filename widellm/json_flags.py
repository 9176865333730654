"""Flags whose value is a JSON object (``--kv-transfer-config``, ``--structured-outputs-config``,
``--eplb-config``, ``--override-generation-config``), given on the command line as text or to
``LLM(...)`` as a dict: one parser, so every such flag refuses bad JSON and unknown keys the
same way."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any


def parse_json_object(value: str | Mapping[str, Any], name: str,
                      known: Iterable[str] | None = None) -> dict[str, Any]:
    """``value`` as a dict; ValueError naming the flag (``name``) when it is not a JSON object
    or, with ``known``, has other keys (a typo must not pass for an applied setting)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}: must be a JSON object")
    if known is not None:
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"{name}: unknown keys {unknown}; known: {sorted(known)}")
    return dict(value)
