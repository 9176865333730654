"""Checks every request body gets before its fields are validated: values that JSON lets a
client send but that no field may hold.

- NaN and +-Infinity (Python's JSON parser accepts them): a NaN ``temperature`` compares
  false with everything, so range checks pass it and sampling silently turns greedy.
- integers beyond 64 bits (``seed``, ``top_k``, ``stop_token_ids``): they fail deep in the
  engine (msgpack, torch) with a 500 instead of a 400.
- strings holding a lone UTF-16 surrogate (``"\\ud800"``): valid JSON, but not encodable as
  UTF-8, so the tokenizer or the response encoder fails with a 500.

Each failure is a ``ValueError`` whose message starts with the top-level field it is in, so
the server's error names that field as ``param``::

    >>> check_json_values({"temperature": float("nan")})
    Traceback (most recent call last):
    ...
    ValueError: temperature: temperature must be a finite number, got nan
"""

from __future__ import annotations

import math
from typing import Any

# The widest integer any request field needs: token ids, seeds and counts are int64 in the
# engine (torch, msgpack).
INT64_MIN = -(2 ** 63)
INT64_MAX = 2 ** 63 - 1


def _problem(value: Any) -> str | None:
    """What is wrong with one JSON scalar, or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        return "must fit in a signed 64-bit integer"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"is not valid Unicode (a lone surrogate at character {e.start})"
    return None


def _in_range_ints(values: list) -> bool:
    """True when ``values`` holds only in-range ints (a token-id prompt), checked at C speed:
    walking a long prompt's ids one by one in Python held the event loop for seconds."""
    return (bool(values) and set(map(type, values)) == {int}
            and INT64_MIN <= min(values) and max(values) <= INT64_MAX)


def _render(path: tuple) -> str:
    """``("messages", (0, ("content", None)))``-style linked path, outermost first."""
    parts: list[str] = []
    while path is not None:
        key, path = path
        parts.append(str(key))
    return ".".join(reversed(parts))


def check_json_values(body: Any) -> None:
    """Raise ValueError for the first bad value anywhere in ``body`` (a parsed JSON value).

    Iterative, not recursive, and paths are linked tuples rendered only on an error: a deeply
    nested body costs neither Python stack nor time quadratic in its depth."""
    if not isinstance(body, dict):
        return  # not an object: the model's own validation rejects it
    for key in body:
        key_problem = _problem(key)
        if key_problem:
            raise ValueError(f"a top-level key {key_problem}")
    stack: list[tuple[str, tuple, Any]] = [(k, (k, None), v) for k, v in body.items()]
    while stack:
        top, path, value = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                key_problem = _problem(k)
                if key_problem:
                    raise ValueError(f"{top}: a key in {_render(path)} {key_problem}")
                stack.append((top, (k, path), v))
        elif isinstance(value, list):
            if _in_range_ints(value):
                continue
            stack.extend((top, (i, path), v) for i, v in enumerate(value))
        else:
            problem = _problem(value)
            if problem:
                raise ValueError(f"{top}: {_render(path)} {problem}")
