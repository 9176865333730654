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
from itertools import chain
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


def _all_fine(values: list) -> bool:
    """True when ``values`` are all strings, all finite floats or all in-range ints (bools
    included), checked at C speed: one UTF-8 encode of the strings joined, ``isfinite``
    over the floats, min and max of the ints. False means "look at each"."""
    kinds = set(map(type, values))
    if kinds == {str}:
        try:
            "".join(values).encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if kinds == {float}:
        return all(map(math.isfinite, values))
    return (bool(kinds) and kinds <= {int, bool}
            and INT64_MIN <= min(values) and max(values) <= INT64_MAX)


def _bulk_fine(values: list) -> bool:
    """True when ``values`` and everything nested in them is certainly fine, one level at a
    time at C speed: a level of only lists is flattened into one list, a level of only dicts
    into their keys (checked) and their values. False (a bad value, or a level mixing kinds)
    means "walk it and name what is wrong". Walking a 4 MiB body value by value in Python
    held the event loop for seconds (a million one-element lists: 2.7 s)."""
    while values:
        kinds = set(map(type, values))
        if kinds == {list}:
            values = list(chain.from_iterable(values))
        elif kinds == {dict}:
            if not _all_fine(list(chain.from_iterable(values))):
                return False
            values = list(chain.from_iterable(map(dict.values, values)))
        else:
            return _all_fine(values)
    return True


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
    # Entries: (top-level field, path, value, whether to try the bulk check first). Below a
    # value whose bulk check failed, only single levels are checked in bulk: trying every
    # level of a deep body in bulk again would cost time quadratic in its depth.
    stack: list[tuple[str, tuple, Any, bool]] = [
        (k, (k, None), v, True) for k, v in body.items()]
    while stack:
        top, path, value, bulk = stack.pop()
        if isinstance(value, dict):
            if not _all_fine(list(value)):
                for k in value:
                    key_problem = _problem(k)
                    if key_problem:
                        raise ValueError(f"{top}: a key in {_render(path)} {key_problem}")
            values = list(value.values())
            if not (_bulk_fine(values) if bulk else _all_fine(values)):
                stack.extend((top, (k, path), v, False) for k, v in value.items())
        elif isinstance(value, list):
            if not (_bulk_fine(value) if bulk else _all_fine(value)):
                stack.extend((top, (i, path), v, False) for i, v in enumerate(value))
        else:
            problem = _problem(value)
            if problem:
                raise ValueError(f"{top}: {_render(path)} {problem}")
