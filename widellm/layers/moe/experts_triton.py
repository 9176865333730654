"""Routed experts on the device: the contiguous-layout sequence of Triton kernels, with no
host synchronisation.

Rows are grouped by expert (:func:`~widellm.layers.moe.dispatch_ep.sort_by_destination` with
one "rank" per local expert; skipped rows sort last and belong to no expert), the grouped GEMM
computes ``gate_up = x @ w13[e].T`` for every expert's rows in one launch, SiLU-and-mul
follows, the grouped GEMM computes ``down``, and the rows go back to their order. With FP8
weights (DeepGEMM's 128 x 128 block scales) the activations are quantized per token and
128-column group before each GEMM and SiLU-and-mul quantizes its output in the same kernel.

Every size is fixed by the row count and the expert count (the GEMMs' tile list is sized for
the worst case), so the sequence has no host sync and a decode step's MoE layers can be
captured in a CUDA graph. ``reference=True`` runs the same sequence on the ops' torch twins
(which do sync): the tests compare the two in Triton's interpreter.
"""

from __future__ import annotations

import torch

from widellm.layers.moe.dispatch_ep import sort_by_destination


def triton_experts_forward(
    hidden: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
    reference: bool = False,
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` per row's expert.

    Args:
        hidden: ``[N, H]`` rows (bf16, fp16 or fp32; the weights' dtype unless FP8).
        expert_ids: ``[N]`` int64 local expert ids, -1 to skip the row.
        w13: ``[E, 2I, H]`` gate rows then up rows; float8 with ``w13_scale``
            ``[E, 2I / 128, cdiv(H, 128)]`` fp32.
        w2: ``[E, H, I]``; float8 with ``w2_scale`` ``[E, cdiv(H, 128), cdiv(I, 128)]``.
        reference: run the ops' torch twins instead of the Triton kernels.

    Returns:
        ``[N, H]`` in hidden's dtype; zero rows where ``expert_ids`` is -1.
    """
    from widellm.ops import triton_grouped_gemm as plain
    from widellm.ops import triton_grouped_gemm_fp8 as fp8
    from widellm.ops import triton_silu_mul_quant as act

    num_experts = w13.shape[0]
    # An id at or past the expert count would land in the sort's bucket for skipped rows (id
    # E) and be dropped silently: moved past it, it fails the sort's scatter instead.
    checked = expert_ids.masked_fill(expert_ids >= num_experts, num_experts + 1)
    sorted_rows = sort_by_destination(checked[:, None], 1, num_experts)
    order, offsets = sorted_rows.order, plain.expert_offsets(sorted_rows.counts)
    rows = hidden.index_select(0, order)
    if w13_scale is None:
        gemm = (plain.grouped_gemm_contiguous_reference if reference
                else plain.grouped_gemm_contiguous)
        silu_mul = act.silu_and_mul_reference if reference else act.silu_and_mul
        gate_up = gemm(rows, offsets, w13)  # [N, 2I]; zero from offsets[-1] on
        down = gemm(silu_mul(gate_up), offsets, w2)  # [N, H]
    else:
        gemm = (fp8.grouped_gemm_fp8_contiguous_reference if reference
                else fp8.grouped_gemm_fp8_contiguous)
        quant = act.per_token_group_quant_reference if reference else act.per_token_group_quant
        silu_mul_quant = (act.silu_and_mul_quant_reference if reference
                          else act.silu_and_mul_quant)
        gate_up = gemm(*quant(rows), offsets, w13, w13_scale)
        down = gemm(*silu_mul_quant(gate_up), offsets, w2, w2_scale)
    out = torch.zeros_like(hidden)
    out.index_copy_(0, order, down.to(hidden.dtype))
    return out
