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
from widellm.ubatching import UBatchBaton


@dataclass(frozen=True, slots=True)
class DPMetadata:
    """What the data-parallel ranks agreed on for this forward (the step's lockstep vote).

    Attributes:
        num_tokens_across_dp: rows of each rank's forward this step, in rank order (a rank
            without work runs a dummy batch and counts its rows). Backends that pad every
            rank to the same size read the largest here instead of agreeing per layer.
    """

    num_tokens_across_dp: tuple[int, ...]

    @property
    def max_num_tokens(self) -> int:
        return max(self.num_tokens_across_dp)

    def micro_batch(self, index: int) -> "DPMetadata":
        """The agreement of micro-batch ``index`` of a split step: every rank splits its rows
        by :func:`micro_batch_rows`, so each knows the others' halves from their totals."""
        return DPMetadata(tuple(micro_batch_rows(n)[index] for n in self.num_tokens_across_dp))


def micro_batch_rows(num_rows: int) -> tuple[int, int]:
    """Rows of the two micro-batches of a step of ``num_rows``: the first takes the larger
    half. A one-row (dummy) batch runs one row in each, so both micro-batches of every rank
    take part in every collective. ``7 -> (4, 3)``, ``8 -> (4, 4)``, ``1 -> (1, 1)``."""
    first = max(1, (num_rows + 1) // 2)
    return first, max(1, num_rows - first)


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: Any  # layers.attention_metadata.AttentionMetadata
    step_timer: StepTimer | None = None  # set when the step-time breakdown is collected
    dp_metadata: DPMetadata | None = None  # set under expert parallelism over several ranks
    ubatch: UBatchBaton | None = None  # set in each micro-batch of a dual-batch-overlap step


_CONTEXT: contextvars.ContextVar[ForwardContext] = contextvars.ContextVar("widellm_forward_context")


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: Any, step_timer: StepTimer | None = None,
    dp_metadata: DPMetadata | None = None, ubatch: UBatchBaton | None = None,
) -> Iterator[None]:
    if _CONTEXT.get(None) is not None:
        raise RuntimeError("forward contexts do not nest")
    token = _CONTEXT.set(ForwardContext(attn_metadata, step_timer, dp_metadata, ubatch))
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


def dbo_yield() -> None:
    """A hand-over point: called right after a transfer is launched. Under dual-batch overlap
    the other micro-batch runs until its own next launch; otherwise nothing happens."""
    ctx = _CONTEXT.get(None)
    if ctx is not None and ctx.ubatch is not None:
        ctx.ubatch.yield_turn()
