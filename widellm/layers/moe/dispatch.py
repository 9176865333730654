"""Dispatch/combine: move routed tokens to the ranks that hold their experts and back.

Every backend splits both directions into a *launch* half (start the transfer, return a
handle) and a *wait* half (block on the handle), so that overlapping communication with the
other micro-batch's compute is only a matter of scheduling the calls:

    handle = d.dispatch_launch(hidden, topk_ids, topk_weights)
    d.dispatch_send(handle)                          # second exchange, if the backend has one
    tokens = d.dispatch_wait(handle)                 # rows for this rank's experts
    out = experts(tokens.hidden_states, tokens.expert_ids)
    chandle = d.combine_launch(out, handle)
    y = d.combine_wait(chandle)                      # [T, H], original token order

Experts are addressed globally by the router and locally by the weights; ``expert_map``
(``[E_global]`` int64) gives each global expert's index in this rank's stacked weights, or -1
when another rank holds it. ``topk_ids`` of -1 mark padding rows: they are never computed and
contribute zero.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from widellm.ops.cpu_kernels import elementwise_kernels

# Marks a (token, slot) pair that must not be computed: padding, or an expert on another rank.
SKIP_EXPERT_ID = -1


@dataclass
class DispatchedTokens:
    """The rows this rank's experts must compute (``N`` of them).

    Attributes:
        hidden_states: ``[N, H]`` activations, in the dtype of the layer input.
        expert_ids: ``[N]`` int64 *local* expert index per row, -1 for rows to skip.
        topk_weights: ``[N]`` fp32 gate weight of each row (0 for skipped rows). Backends that
            weight on the expert side use it; :class:`LocalDispatcher` weights in combine.
    """

    hidden_states: torch.Tensor
    expert_ids: torch.Tensor
    topk_weights: torch.Tensor


class DispatchHandle:
    """Opaque state from ``dispatch_launch`` that ``dispatch_wait`` and ``combine_launch`` use."""


class CombineHandle:
    """Opaque state from ``combine_launch`` that ``combine_wait`` finishes."""


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """Translate global expert ids to this rank's local ids.

    Args:
        topk_ids: ``[T, k]`` int64 global ids, -1 for padding.
        expert_map: ``[E_global]`` int64 local index or -1.

    Returns:
        ``[T, k]`` int64 local ids; -1 for padding and for experts held elsewhere.
    """
    is_pad = topk_ids < 0
    mapped = expert_map[topk_ids.masked_fill(is_pad, 0)]
    return mapped.masked_fill(is_pad, SKIP_EXPERT_ID)


def _check_expert_map(expert_map: torch.Tensor) -> int:
    """Validate ``expert_map`` and return the number of local experts."""
    if expert_map.dim() != 1 or expert_map.dtype != torch.int64:
        raise ValueError("expert_map must be a 1-D int64 tensor [E_global]")
    local = expert_map[expert_map >= 0]
    num_local = local.numel()
    # Local ids index the stacked weights, so they must be exactly 0..E_local-1.
    if not torch.equal(local.sort().values.cpu(), torch.arange(num_local)):
        raise ValueError("expert_map's local ids must be a permutation of 0..E_local-1")
    return num_local


class MoEDispatcher(ABC):
    """Base class of dispatch/combine backends.

    Args:
        expert_map: ``[E_global]`` int64, local index of each global expert or -1.
    """

    def __init__(self, expert_map: torch.Tensor) -> None:
        self.num_local_experts = _check_expert_map(expert_map)
        self.num_global_experts = expert_map.numel()
        self.expert_map = expert_map

    @abstractmethod
    def dispatch_launch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        num_tokens_across_ranks: Sequence[int] | None = None,
    ) -> DispatchHandle:
        """Start sending tokens to their experts; returns without waiting on any collective
        or host sync.

        Args:
            hidden_states: ``[T, H]``.
            topk_ids: ``[T, k]`` int64 global expert ids, -1 for padding.
            topk_weights: ``[T, k]`` fp32 gate weights.
            num_tokens_across_ranks: every rank's ``T`` for this call, as the step's lockstep
                vote agreed (the forward context's ``dp_metadata``); a backend that needs it
                and does not get it agrees on it with a blocking collective (use outside an
                engine step only).
        """

    def capturable(self, counts: Sequence[int], top_k: int) -> bool:
        """Whether a forward whose ranks hold ``counts`` rows (``top_k`` experts per token) runs
        this backend with no host sync and no size exchange, so a CUDA graph can record it and
        replay it whatever the other ranks run that step. Host arithmetic on agreed values:
        every rank answers the same."""
        return False

    def dispatch_send(self, handle: DispatchHandle) -> bool:
        """Launch the rows where the backend first exchanges their sizes: waits for the sizes
        (a host sync), then starts the rows' transfer. Returns whether it launched one, so the
        caller can hand over to the other micro-batch (and run local work, such as the shared
        experts) while the rows travel. Single-exchange backends launch everything in
        ``dispatch_launch``: False."""
        return False

    @abstractmethod
    def dispatch_wait(self, handle: DispatchHandle) -> DispatchedTokens:
        """Finish the dispatch (``dispatch_send`` first, if the caller skipped it) and return
        the rows for this rank's experts."""

    @abstractmethod
    def combine_launch(self, expert_output: torch.Tensor, handle: DispatchHandle) -> CombineHandle:
        """Start sending expert outputs back.

        Args:
            expert_output: ``[N, H]`` unweighted expert outputs, row-aligned with the
                :class:`DispatchedTokens` of ``handle``; skipped rows must be zero.
            handle: the handle of the matching dispatch.
        """

    @abstractmethod
    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        """Finish the combine: ``[T, H]`` weighted sum over each token's k experts."""


@dataclass
class _LocalDispatchHandle(DispatchHandle):
    tokens: DispatchedTokens
    # [T, k] fp32 gate weights, zeroed where the expert is skipped.
    topk_weights: torch.Tensor
    out_dtype: torch.dtype


@dataclass
class _LocalCombineHandle(CombineHandle):
    output: torch.Tensor


def combine_reference(
    expert_output: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``[T, H]`` = sum over j of ``topk_weights[t, j] * expert_output[t * k + j]``, summed in
    fp32 in slot order and rounded once to ``out_dtype``; the reference twin of the
    ``moe_combine`` CPU kernel.

    Args:
        expert_output: ``[T * k, H]`` rows in token-major order.
        topk_weights: ``[T, k]`` fp32, zero for skipped slots.
    """
    num_tokens, top_k = topk_weights.shape
    # Explicit H, not -1: with T = 0 (an empty batch) -1 is ambiguous.
    per_slot = expert_output.view(num_tokens, top_k, expert_output.shape[-1])
    # Accumulate the k contributions in fp32, one [T, H] slice at a time, so low-precision
    # activations lose nothing in the sum and no [T, k, H] fp32 temporary is needed.
    acc = torch.zeros(
        num_tokens, per_slot.shape[-1], dtype=torch.float32, device=expert_output.device
    )
    for slot in range(top_k):
        acc.addcmul_(per_slot[:, slot], topk_weights[:, slot : slot + 1])
    return acc.to(out_dtype)


class LocalDispatcher(MoEDispatcher):
    """Single-rank backend: no communication, rows are laid out token-major (``N = T * k``).

    Row ``t * k + j`` of the dispatched tokens is token ``t``'s ``j``-th expert. An
    ``expert_map`` with -1 entries computes only the local experts' share of the output, which
    is what an expert-parallel rank contributes before a reduction.
    """

    def capturable(self, counts: Sequence[int], top_k: int) -> bool:
        return True

    def dispatch_launch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        num_tokens_across_ranks: Sequence[int] | None = None,
    ) -> DispatchHandle:
        num_tokens, top_k = topk_ids.shape
        hidden_size = hidden_states.shape[-1]
        expert_ids = local_expert_ids(topk_ids, self.expert_map)
        skipped = expert_ids < 0
        # masked_fill, not multiply: padding rows may carry NaN weights from garbage logits.
        weights = topk_weights.float().masked_fill(skipped, 0.0)
        rows = hidden_states.unsqueeze(1).expand(num_tokens, top_k, hidden_size)
        tokens = DispatchedTokens(
            hidden_states=rows.reshape(num_tokens * top_k, hidden_size),
            expert_ids=expert_ids.reshape(-1),
            topk_weights=weights.reshape(-1),
        )
        return _LocalDispatchHandle(tokens=tokens, topk_weights=weights, out_dtype=hidden_states.dtype)

    def dispatch_wait(self, handle: DispatchHandle) -> DispatchedTokens:
        assert isinstance(handle, _LocalDispatchHandle)
        return handle.tokens

    def combine_launch(self, expert_output: torch.Tensor, handle: DispatchHandle) -> CombineHandle:
        assert isinstance(handle, _LocalDispatchHandle)
        weights = handle.topk_weights
        kernels = elementwise_kernels(expert_output)
        if kernels is not None and expert_output.dtype == handle.out_dtype:
            # One pass over the k rows of each token (the loop below reads and writes an fp32
            # accumulator k times: ~4x the memory traffic at prefill sizes).
            output = kernels.moe_combine(expert_output.contiguous(), weights.contiguous())
        else:
            output = combine_reference(expert_output, weights, handle.out_dtype)
        return _LocalCombineHandle(output=output)

    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        assert isinstance(handle, _LocalCombineHandle)
        return handle.output
