"""The per-step forward context: what every layer of one forward pass may read.

Scoped and non-nesting: the model runner enters it around one forward pass; layers read it
with ``get_forward_context()``. It lives in a ContextVar, so threads never see each other's.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from widellm.step_timer import StepTimer


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: Any  # layers.attention_metadata.AttentionMetadata
    step_timer: StepTimer | None = None  # set when the step-time breakdown is collected


_CONTEXT: contextvars.ContextVar[ForwardContext] = contextvars.ContextVar("widellm_forward_context")


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: Any, step_timer: StepTimer | None = None
) -> Iterator[None]:
    if _CONTEXT.get(None) is not None:
        raise RuntimeError("forward contexts do not nest")
    token = _CONTEXT.set(ForwardContext(attn_metadata, step_timer))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_forward_context() -> ForwardContext | None:
    """The context if inside a forward, else None (for layers usable outside one, like MoE)."""
    return _CONTEXT.get(None)


def get_forward_context() -> ForwardContext:
    ctx = _CONTEXT.get(None)
    if ctx is None:
        raise RuntimeError("attention layers run only inside set_forward_context()")
    return ctx
