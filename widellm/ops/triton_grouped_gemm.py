"""MoE grouped GEMM in Triton: every expert multiplies its own rows by its own weight, in one
kernel launch for all experts, in the two layouts expert parallelism produces.

* **Contiguous** (prefill): ``x [M, K]`` rows sorted by expert, ``expert_offsets [E + 1]``;
  expert ``e`` owns rows ``offsets[e]:offsets[e + 1]`` (empty experts allowed). The sort itself
  is :func:`widellm.layers.moe.dispatch_ep.sort_by_destination` with ``experts_per_rank=1``
  and ``ep_size=E`` (pairs with id -1 sort last and are not counted); :func:`expert_offsets`
  turns its counts into the offsets.
* **Masked** (decode, fixed-capacity buffers as DeepEP low-latency dispatch fills them):
  ``x [E, C, K]`` with ``counts [E]`` valid rows per expert; the rows past a count are padding
  and are never read.

Weights are stacked in ``nn.Linear`` layout, ``w [E, N, K]``, as
:mod:`widellm.layers.moe.experts` stores ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``: ``y = x @
w[e].T``. Both layouts run one kernel over a list of ``BLOCK_M``-row tiles, each inside one
expert, so the weights are read with no gather and no row ever mixes experts. Accumulation is
fp32; :mod:`widellm.ops.triton_grouped_gemm_fp8` adds FP8 W8A8 with DeepGEMM's scales on the
same kernel. Everything stays on the device: no host sync, so the masked path can be captured
in a CUDA graph as is.

Each entry point has a plain torch twin (``*_reference``): a per-expert fp32 matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tile shape. BLOCK_K is also the FP8 scale group (1 x 128 activations, 128 x 128 weights),
# so one K step needs exactly one activation scale per row and one weight scale per column.
BLOCK_K = 128
BLOCK_N = 128
# Prefill tiles: 64 rows keep the tensor cores busy while wasting at most 63 rows per expert.
CONTIGUOUS_BLOCK_M = 64
# Masked tiles follow the capacity, between tl.dot's smallest M and the prefill tile.
MIN_BLOCK_M = 16
MAX_MASKED_BLOCK_M = 64
# Scale group of DeepSeek-V3's FP8 checkpoints (weight_scale_inv) and of DeepGEMM.
FP8_GROUP = 128
# Row-tile entry that belongs to no expert (the contiguous tile list is sized for the worst
# case, so its tail is unused).
NO_EXPERT = -1
# Activation/weight dtypes of the non-FP8 path: bf16/fp16 on tensor cores, fp32 with full
# fp32 products ("ieee": tf32 would cost ~1e-3 relative error; fp32 is the dtype the engine's
# exactness tests run in).
HALF_DTYPES = (torch.bfloat16, torch.float16)
PLAIN_DTYPES = HALF_DTYPES + (torch.float32,)


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, y_ptr, x_scale_ptr, w_scale_ptr,
    tile_expert_ptr, tile_row_start_ptr, tile_row_end_ptr, counts_ptr,
    N, K, capacity,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_ym, stride_yn,
    stride_xsm, stride_xsk, stride_wse, stride_wsn, stride_wsk,
    MASKED: tl.constexpr, FP8: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: ``BLOCK_M`` rows of one expert times ``BLOCK_N`` output columns.

    Rows ``[row_start, valid_end)`` of the tile are computed, rows up to ``store_end`` are
    written (as zeros past ``valid_end``: masked padding), nothing else is touched.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if MASKED:
        tiles_per_expert = tl.cdiv(capacity, BLOCK_M)
        expert = pid_m // tiles_per_expert
        first_row = expert * capacity
        row_start = first_row + (pid_m % tiles_per_expert) * BLOCK_M
        # A count past the capacity must not read the next expert's buffer.
        count = tl.minimum(tl.maximum(tl.load(counts_ptr + expert), 0), capacity)
        valid_end = first_row + count
        store_end = first_row + capacity
    else:
        expert = tl.load(tile_expert_ptr + pid_m)
        row_start = tl.load(tile_row_start_ptr + pid_m)
        valid_end = tl.load(tile_row_end_ptr + pid_m)
        store_end = valid_end
    if expert < 0:
        return

    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < valid_end
    col_ok = cols < N
    # int64 offsets: E * N * K of a real model's expert weights passes 2**31 elements.
    rows64 = rows.to(tl.int64)
    expert64 = expert.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * stride_xm
    w_cols = w_ptr + expert64 * stride_we + cols.to(tl.int64)[None, :] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A tile of padding only (masked layout) skips the K loop and stores its zeros.
    num_k_blocks = tl.where(row_start < valid_end, tl.cdiv(K, BLOCK_K), 0)
    for kb in range(0, num_k_blocks):
        ks = kb * BLOCK_K + offs_k
        k_ok = ks < K
        # Masked-off rows load as 0, so padding (even NaN) never reaches an output.
        a = tl.load(x_rows + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + ks[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8:
            # BLOCK_K == GROUP: K block kb is scale group kb for both operands. The fp8
            # product of one group is scaled into the fp32 accumulator, so tensor cores'
            # reduced fp8 accumulation precision (Hopper) spans at most one group.
            a_scale = tl.load(x_scale_ptr + rows64 * stride_xsm + kb * stride_xsk,
                              mask=row_ok, other=0.0)
            b_scale = tl.load(w_scale_ptr + expert64 * stride_wse
                              + (cols // GROUP) * stride_wsn + kb * stride_wsk,
                              mask=col_ok, other=0.0)
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        else:
            if UPCAST_DOT:
                # Triton's CPU interpreter multiplies bf16 operands wrongly (seen in 3.9);
                # bf16 -> fp32 is exact, so the result is the same product.
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

    y_ptrs = y_ptr + rows64[:, None] * stride_ym + cols.to(tl.int64)[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty),
             mask=(rows < store_end)[:, None] & col_ok[None, :])


def expert_offsets(counts: torch.Tensor) -> torch.Tensor:
    """counts [E] int (rows per expert) -> offsets [E + 1] int64, ``offsets[0] = 0``."""
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int64)


def contiguous_tiles(
    offsets: torch.Tensor, num_rows: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split every expert's rows into ``block_m``-row tiles, on the device (no host sync).

    Args:
        offsets: ``[E + 1]`` int, nondecreasing, ``offsets[E] <= num_rows``.
        num_rows: ``M``, rows of the sorted activations (sizes the tile list).
        block_m: rows per tile.

    Returns:
        ``(tile_expert, tile_row_start, tile_row_end)``, each ``[cdiv(M, block_m) + E]``
        int32: the tile's expert (-1 for unused tail entries), its first row, and its
        expert's end row (the tile covers ``[start, min(start + block_m, end))``).
    """
    num_experts = offsets.numel() - 1
    offsets = offsets.to(torch.int64)
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    # Each expert wastes less than one tile: sum(cdiv(c_e, b)) < M / b + E.
    max_tiles = triton.cdiv(num_rows, block_m) + num_experts
    tile = torch.arange(max_tiles, device=offsets.device)
    expert = torch.searchsorted(tile_end, tile, right=True)
    used = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    row_start = offsets[expert] + (tile - (tile_end[expert] - tiles[expert])) * block_m
    tile_expert = torch.where(used, expert, NO_EXPERT)
    return (tile_expert.to(torch.int32), row_start.to(torch.int32),
            offsets[expert + 1].to(torch.int32))


def masked_block_m(capacity: int) -> int:
    """Tile rows for a masked buffer of ``capacity`` rows per expert."""
    return min(max(triton.next_power_of_2(max(capacity, 1)), MIN_BLOCK_M), MAX_MASKED_BLOCK_M)


def launch_grouped_gemm(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    counts: torch.Tensor | None = None, capacity: int = 0,
    x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
    block_m: int,
) -> None:
    """Run the kernel; the layout entry points check shapes and call this.

    x [rows, K] and y [rows, N] (masked buffers flattened to ``rows = E * C``); w [E, N, K];
    either ``tiles`` (contiguous, from :func:`contiguous_tiles`) or ``counts [E]`` and
    ``capacity`` (masked). FP8 when ``x_scale [rows, cdiv(K, 128)]`` and
    ``w_scale [E, cdiv(N, 128), cdiv(K, 128)]`` are given.
    """
    num_experts, n, k = w.shape
    masked = counts is not None
    fp8 = x_scale is not None
    if masked:
        grid_m = num_experts * triton.cdiv(capacity, block_m)
        tile_expert = tile_row_start = tile_row_end = counts
    else:
        tile_expert, tile_row_start, tile_row_end = tiles
        grid_m = tile_expert.numel()
        counts = tile_expert
    if grid_m == 0 or n == 0:
        return  # nothing to compute (zero capacity, no experts or no columns)
    if not fp8:
        # Unused pointer arguments; the FP8 branch that reads them is compiled out.
        x_scale = w_scale = x.new_empty(1, 1, 1, dtype=torch.float32)
    scale_x_strides = x_scale.stride()[-2:]
    grid = (grid_m, triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        x, w, y, x_scale, w_scale,
        tile_expert, tile_row_start, tile_row_end, counts,
        n, k, capacity,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        y.stride(0), y.stride(1),
        scale_x_strides[0], scale_x_strides[1],
        w_scale.stride(0), w_scale.stride(1), w_scale.stride(2),
        MASKED=masked, FP8=fp8, UPCAST_DOT=x.device.type != "cuda",
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GROUP=FP8_GROUP,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )


def check_weight(w: torch.Tensor, k: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """w must be [E, N, K] in one of ``dtypes`` with the activations' K."""
    if w.dim() != 3 or w.shape[2] != k:
        raise ValueError(f"weights {tuple(w.shape)} must be [E, N, K={k}]")
    if w.dtype not in dtypes:
        raise ValueError(f"weights dtype {w.dtype} not in {dtypes}")



def grouped_gemm_contiguous(
    x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """Contiguous-layout grouped GEMM, bf16 (fp16, fp32) in, fp32 accumulate.

    Args:
        x: ``[M, K]`` bf16 rows sorted by expert.
        offsets: ``[E + 1]`` int32/int64, nondecreasing, ``offsets[E] <= M`` (not checked:
            that would sync with the host); expert ``e`` owns rows ``offsets[e]:offsets[e+1]``.
        w: ``[E, N, K]`` in x's dtype (nn.Linear layout).

    Returns:
        ``[M, N]`` in x's dtype; ``y[r] = x[r] @ w[e].T`` for the expert owning row ``r``,
        zero for rows no expert owns (before ``offsets[0]`` or from ``offsets[E]`` on).
    """
    check_weight(w, x.shape[-1], PLAIN_DTYPES)
    if x.dim() != 2 or x.dtype != w.dtype or offsets.shape != (w.shape[0] + 1,):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}, offsets {tuple(offsets.shape)} do not "
                         f"match weights {tuple(w.shape)} {w.dtype}")
    y = x.new_zeros(x.shape[0], w.shape[1])
    tiles = contiguous_tiles(offsets, x.shape[0], CONTIGUOUS_BLOCK_M)
    launch_grouped_gemm(x, w, y, tiles=tiles, block_m=CONTIGUOUS_BLOCK_M)
    return y


def grouped_gemm_masked(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Masked-layout grouped GEMM, bf16 (fp16, fp32) in, fp32 accumulate.

    Args:
        x: ``[E, C, K]`` bf16; rows ``[counts[e], C)`` of expert ``e`` are padding (any bits,
            NaN included) and are never read.
        counts: ``[E]`` int32/int64 valid rows per expert, read as ``clamp(count, 0, C)``.
        w: ``[E, N, K]`` in x's dtype.

    Returns:
        ``[E, C, N]`` in x's dtype; padded rows are **zero** (so a combine may sum them).
    """
    check_weight(w, x.shape[-1], PLAIN_DTYPES)
    num_experts, capacity, k = x.shape
    if x.dtype != w.dtype or x.shape[0] != w.shape[0] or counts.shape != (num_experts,):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}, counts {tuple(counts.shape)} do not "
                         f"match weights {tuple(w.shape)} {w.dtype}")
    y = x.new_empty(num_experts, capacity, w.shape[1])
    launch_grouped_gemm(x.reshape(-1, k), w, y.view(-1, w.shape[1]), counts=counts,
                        capacity=capacity, block_m=masked_block_m(capacity))
    return y


def grouped_gemm_contiguous_reference(
    x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Twin of :func:`grouped_gemm_contiguous`: each expert's slice times its weight in fp32.

    Any float dtypes (the FP8 twins pass dequantized fp32 tensors); the result is rounded once
    to ``out_dtype`` (default x's dtype; fp32 keeps the unrounded sums for tests).
    """
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    bounds = offsets.tolist()
    for expert in range(w.shape[0]):
        start, end = bounds[expert], bounds[expert + 1]
        out[start:end] = x[start:end].float() @ w[expert].float().T
    return out.to(out_dtype or x.dtype)


def grouped_gemm_masked_reference(
    x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Twin of :func:`grouped_gemm_masked`: per expert, its first ``count`` rows times its
    weight in fp32; padded rows zero. Dtypes as in :func:`grouped_gemm_contiguous_reference`."""
    num_experts, capacity, _ = x.shape
    out = torch.zeros(num_experts, capacity, w.shape[1], dtype=torch.float32, device=x.device)
    for expert, count in enumerate(counts.clamp(0, capacity).tolist()):
        out[expert, :count] = x[expert, :count].float() @ w[expert].float().T
    return out.to(out_dtype or x.dtype)
