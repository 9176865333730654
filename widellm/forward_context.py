"""The per-step forward context: attention metadata that every attention layer reads.

Scoped and non-nesting: the model runner enters it around one forward pass; layers read it
with ``get_forward_context()``. It lives in a ContextVar, so threads never see each other's.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_CONTEXT: contextvars.ContextVar[Any] = contextvars.ContextVar("widellm_forward_context")


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    if _CONTEXT.get(None) is not None:
        raise RuntimeError("forward contexts do not nest")
    token = _CONTEXT.set(attn_metadata)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def get_forward_context() -> Any:
    ctx = _CONTEXT.get(None)
    if ctx is None:
        raise RuntimeError("attention layers run only inside set_forward_context()")
    return ctx
