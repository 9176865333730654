"""Routed-expert MLPs over dispatched rows: ``down(silu(gate(x)) * up(x))`` per row's expert.

Weights are stacked per local expert: ``w13 [E_local, 2I, H]`` holds the gate projection (w1)
in rows ``[0, I)`` and the up projection (w3) in rows ``[I, 2I)``; ``w2 [E_local, H, I]`` is
the down projection. Rows whose expert id is -1 are skipped and come out as zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from widellm.layers.activation import silu_and_mul
from widellm.layers.moe.experts_triton import triton_experts_forward
from widellm.ops.cpu_kernels import load_cpu_kernels


# Row counts up to this are rounded to a power of two, larger ones to a multiple of it.
ROW_BUCKET = 64
MAX_ROW_PADDING = ROW_BUCKET - 1


def bucket_rows(num_rows: int) -> int:
    """1, 2, 4, ... 64, then multiples of 64: few distinct GEMM shapes, little waste."""
    if num_rows <= ROW_BUCKET:
        return 1 << (num_rows - 1).bit_length()
    return -(-num_rows // ROW_BUCKET) * ROW_BUCKET


def _check_shapes(
    hidden: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> None:
    num_experts, two_inter, hidden_size = w13.shape
    if w2.shape != (num_experts, hidden_size, two_inter // 2):
        raise ValueError(f"w2 shape {tuple(w2.shape)} does not match w13 shape {tuple(w13.shape)}")
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden shape {tuple(hidden.shape)} does not match hidden_size={hidden_size}")
    if expert_ids.shape != (hidden.shape[0],):
        raise ValueError(f"expert_ids shape {tuple(expert_ids.shape)} must be ({hidden.shape[0]},)")


def grouped_experts_forward(
    hidden: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Grouped GEMM over rows sorted by expert (contiguous layout).

    Rows are stably sorted by expert id (skipped rows last), each expert multiplies its
    contiguous slice with one ``mm`` per projection, and the results are scattered back. The
    only host synchronisation is one ``tolist()`` of the per-expert row counts.

    Args:
        hidden: ``[N, H]`` rows to compute, same dtype as the weights.
        expert_ids: ``[N]`` int64 local expert ids, -1 to skip the row.
        w13: ``[E_local, 2I, H]`` fused gate (w1) and up (w3) projections.
        w2: ``[E_local, H, I]`` down projection.

    Returns:
        ``[N, H]`` expert outputs in the input row order; zero rows where ``expert_ids`` is -1.
    """
    _check_shapes(hidden, expert_ids, w13, w2)
    num_rows, hidden_size = hidden.shape
    num_experts = w13.shape[0]
    # Skipped rows go to bucket E + 1 so they sort after every real expert; out-of-range ids
    # are clamped into bucket E, which must stay empty (checked at the one host sync).
    bad_bucket, skip_bucket = num_experts, num_experts + 1
    sort_keys = torch.where(expert_ids >= 0, expert_ids.clamp(max=bad_bucket), skip_bucket)
    order = torch.argsort(sort_keys, stable=True)
    counts = torch.bincount(sort_keys, minlength=skip_bucket + 1).tolist()
    if counts[bad_bucket] != 0:
        raise ValueError(f"expert id out of range for {num_experts} local experts")

    num_valid = num_rows - counts[skip_bucket]
    valid_order = order[:num_valid]
    # Spare rows after the last expert's let every slice be rounded up to a bucket size.
    sorted_hidden = hidden.new_empty(num_valid + MAX_ROW_PADDING, hidden_size)
    torch.index_select(hidden, 0, valid_order, out=sorted_hidden[:num_valid])
    sorted_hidden[num_valid:].zero_()
    sorted_out = torch.empty_like(sorted_hidden[:num_valid])
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count == 0:
            continue
        end = start + count
        # Each expert multiplies a bucketed number of rows (the extra ones belong to the next
        # expert or are spare, and their results are dropped): oneDNN builds a kernel per
        # distinct shape, and a new row count for every expert at every step would rebuild
        # kernels all the time (3-8x slower). F.linear takes the [out, in] weight as stored,
        # about twice as fast as mm with a transposed view.
        rows = sorted_hidden[start:start + bucket_rows(count)]
        gate_up = F.linear(rows, w13[expert])
        sorted_out[start:end] = F.linear(silu_and_mul(gate_up), w2[expert])[:count]
        start = end

    out = hidden.new_zeros(num_rows, hidden_size)
    out.index_copy_(0, valid_order, sorted_out)
    return out


def masked_experts_forward(
    hidden: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Grouped GEMM in the masked layout: rows are scattered into ``[E, P, H]`` (``P`` = the
    busiest expert's row count, bucketed) and each projection is one batched matmul over all
    experts; padding rows are zero and their results dropped.

    Meant for decode, where every expert gets a handful of rows: one ``bmm`` replaces a Python
    loop of E small matmuls (and it is the layout fixed-shape GPU graphs need). Same arguments
    and result as :func:`grouped_experts_forward`.
    """
    _check_shapes(hidden, expert_ids, w13, w2)
    num_rows, hidden_size = hidden.shape
    num_experts = w13.shape[0]
    valid = expert_ids >= 0
    if bool((expert_ids >= num_experts).any()):
        raise ValueError(f"expert id out of range for {num_experts} local experts")
    rows = valid.nonzero().squeeze(1)
    experts = expert_ids[rows]
    order = torch.argsort(experts, stable=True)
    rows, experts = rows[order], experts[order]
    counts = torch.bincount(experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    pad_rows = bucket_rows(max(int(counts.max()), 1)) if rows.numel() else 1
    # Slot of each row in the [E, P] grid: its expert's block, then its rank inside it.
    slots = experts * pad_rows + torch.arange(rows.numel()) - starts[experts]
    grid = hidden.new_zeros(num_experts * pad_rows, hidden_size)
    grid.index_copy_(0, slots, hidden.index_select(0, rows))
    gate_up = torch.bmm(grid.view(num_experts, pad_rows, hidden_size), w13.transpose(1, 2))
    down = torch.bmm(silu_and_mul(gate_up), w2.transpose(1, 2))
    out = hidden.new_zeros(num_rows, hidden_size)
    out.index_copy_(0, rows, down.view(-1, hidden_size).index_select(0, slots))
    return out


# Masked layout pays for every expert up to the busiest one's (bucketed) row count; it wins
# when most experts get a few rows each (decode batches), the contiguous layout when rows are
# many (prefill), few experts are hit, or the load is skewed (one hot expert would pad every
# other expert to its size).
MASKED_MIN_ROWS_PER_EXPERT = 2
MASKED_MAX_ROWS_PER_EXPERT = 16
# Most grid rows per real row the masked layout may compute (bounds the padding waste).
MASKED_MAX_PADDING = 4


def prefers_masked_layout(expert_ids: torch.Tensor, num_experts: int) -> bool:
    """Whether :func:`masked_experts_forward` should compute these rows (one host sync)."""
    valid = expert_ids[expert_ids >= 0]
    num_valid = valid.numel()
    if not MASKED_MIN_ROWS_PER_EXPERT <= num_valid / num_experts <= MASKED_MAX_ROWS_PER_EXPERT:
        return False
    busiest = int(torch.bincount(valid, minlength=num_experts).max())
    return num_experts * bucket_rows(busiest) <= MASKED_MAX_PADDING * num_valid


# The dot-product kernel (CPUs with AVX512-BF16 but no AMX, or sizes AMX tiles do not divide)
# beats the grouped matmuls only while experts get a few rows each.
DOT_KERNEL_MAX_ROWS_PER_EXPERT = 8


def _fused_experts_kernels(hidden: torch.Tensor):
    """widellm's CPU kernels for rows the fused experts kernel takes (bf16 on CPU), else None."""
    if hidden.device.type != "cpu" or hidden.dtype != torch.bfloat16:
        return None
    return load_cpu_kernels()


def fused_experts_backend(hidden: torch.Tensor, w13: torch.Tensor) -> str | None:
    """The CPU kernel path :func:`experts_forward` takes for these rows, or None for torch's.

    ``"amx"`` (tile products, fastest at every batch size measured) or ``"avx512_bf16"`` (dot
    products, decode-sized batches only); bf16 only, fp32 and fp16 keep the torch paths.
    """
    kernels = _fused_experts_kernels(hidden)
    if kernels is None:
        return None
    num_experts, two_inter, hidden_size = w13.shape
    backend = kernels.fused_experts_backend(hidden_size, two_inter // 2)
    if backend == "amx":
        return backend
    few_rows = hidden.shape[0] <= DOT_KERNEL_MAX_ROWS_PER_EXPERT * num_experts
    return backend if backend == "avx512_bf16" and few_rows else None


def fused_experts_forward(
    hidden: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Both projections and the gate in one CPU kernel call (``ops/cpu/moe.cpp``): each
    expert's weights are streamed once for all of its rows, whatever the routing skew, with
    no host sync, no Python loop and no padding. bf16 only; same arguments and result as
    :func:`grouped_experts_forward`, up to the order of the fp32 sums in each dot product.
    """
    _check_shapes(hidden, expert_ids, w13, w2)
    kernels = _fused_experts_kernels(hidden)
    if kernels is None:
        raise RuntimeError("fused_experts_forward needs widellm's CPU kernels and bf16 rows")
    return kernels.fused_experts(
        hidden.contiguous(), expert_ids.contiguous(), w13.contiguous(), w2.contiguous()
    )


def experts_forward(
    hidden: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Pick the fused kernel where it runs, else the layout by the rows each expert gets; all
    give the reference result. On a GPU: the Triton kernels, with no host sync (so decode
    steps can be captured in CUDA graphs)."""
    if hidden.device.type == "cuda":
        return triton_experts_forward(hidden, expert_ids, w13, w2)
    if fused_experts_backend(hidden, w13) is not None:
        return fused_experts_forward(hidden, expert_ids, w13, w2)
    if prefers_masked_layout(expert_ids, w13.shape[0]):
        return masked_experts_forward(hidden, expert_ids, w13, w2)
    return grouped_experts_forward(hidden, expert_ids, w13, w2)


def reference_experts_forward(
    hidden: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Plain per-expert masked loop; the reference twin of :func:`grouped_experts_forward`.

    Same arguments and result: ``[N, H]`` with zero rows where ``expert_ids`` is -1.
    """
    _check_shapes(hidden, expert_ids, w13, w2)
    out = torch.zeros_like(hidden)
    for expert in range(w13.shape[0]):
        mask = expert_ids == expert
        if not bool(mask.any()):
            continue
        gate_up = F.linear(hidden[mask], w13[expert])
        out[mask] = F.linear(silu_and_mul(gate_up), w2[expert])
    return out
