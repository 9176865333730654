"""FP8 W8A8 MoE grouped GEMM with DeepGEMM's scales, on the kernel of
:mod:`widellm.ops.triton_grouped_gemm`, in the same two layouts.

Scales follow DeepSeek-V3 / DeepGEMM (real value = fp8 value * scale, fp32 scales):

* activations ``float8_e4m3fn [rows, K]`` with per-token-group scales ``[rows, K // 128]``
  (one scale per row per 128 consecutive K elements, "1 x 128");
* weights ``float8_e4m3fn [E, N, K]`` with block scales ``[E, N // 128, K // 128]`` (one per
  128 x 128 block, the ``weight_scale_inv`` tensors of DeepSeek-V3's checkpoints).

Sizes that are not multiples of 128 take ``cdiv`` scale groups (the last group is partial), as
the checkpoints store them. Output is bf16. The twins dequantize (fp8 value * its scale, in
fp32) and then run the plain per-expert fp32 matmul of the bf16 twins.
"""

from __future__ import annotations

import torch
import triton

from widellm.ops.triton_grouped_gemm import (
    CONTIGUOUS_BLOCK_M,
    FP8_GROUP,
    check_weight,
    contiguous_tiles,
    grouped_gemm_contiguous_reference,
    grouped_gemm_masked_reference,
    launch_grouped_gemm,
    masked_block_m,
)

FP8_DTYPE = torch.float8_e4m3fn
OUT_DTYPE = torch.bfloat16


def _check_scales(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                  w_scale: torch.Tensor) -> None:
    """x [..., K] fp8 with x_scale [..., cdiv(K, 128)] fp32; w [E, N, K] fp8 with w_scale
    [E, cdiv(N, 128), cdiv(K, 128)] fp32."""
    k = x.shape[-1]
    check_weight(w, k, (FP8_DTYPE,))
    num_experts, n, _ = w.shape
    groups_k, groups_n = triton.cdiv(k, FP8_GROUP), triton.cdiv(n, FP8_GROUP)
    if x.dtype != FP8_DTYPE or x_scale.shape != (*x.shape[:-1], groups_k):
        raise ValueError(f"activations {tuple(x.shape)} {x.dtype} need {FP8_DTYPE} and scales "
                         f"[..., {groups_k}], got {tuple(x_scale.shape)}")
    if w_scale.shape != (num_experts, groups_n, groups_k):
        raise ValueError(f"weight scales {tuple(w_scale.shape)} must be "
                         f"{(num_experts, groups_n, groups_k)}")
    if x_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise ValueError("FP8 scales must be float32")


def grouped_gemm_fp8_contiguous(
    x: torch.Tensor, x_scale: torch.Tensor, offsets: torch.Tensor,
    w: torch.Tensor, w_scale: torch.Tensor,
) -> torch.Tensor:
    """Contiguous-layout FP8 grouped GEMM (prefill).

    Args:
        x: ``[M, K]`` float8_e4m3fn rows sorted by expert.
        x_scale: ``[M, cdiv(K, 128)]`` fp32 per-token-group scales.
        offsets: ``[E + 1]`` int, as in
            :func:`~widellm.ops.triton_grouped_gemm.grouped_gemm_contiguous`.
        w: ``[E, N, K]`` float8_e4m3fn.
        w_scale: ``[E, cdiv(N, 128), cdiv(K, 128)]`` fp32 block scales.

    Returns:
        ``[M, N]`` bf16; zero for rows no expert owns.
    """
    _check_scales(x, x_scale, w, w_scale)
    if x.dim() != 2 or offsets.shape != (w.shape[0] + 1,):
        raise ValueError(f"x {tuple(x.shape)} / offsets {tuple(offsets.shape)} do not match "
                         f"weights {tuple(w.shape)}")
    y = torch.zeros(x.shape[0], w.shape[1], dtype=OUT_DTYPE, device=x.device)
    tiles = contiguous_tiles(offsets, x.shape[0], CONTIGUOUS_BLOCK_M)
    launch_grouped_gemm(x, w, y, tiles=tiles, x_scale=x_scale, w_scale=w_scale,
                        block_m=CONTIGUOUS_BLOCK_M)
    return y


def grouped_gemm_fp8_masked(
    x: torch.Tensor, x_scale: torch.Tensor, counts: torch.Tensor,
    w: torch.Tensor, w_scale: torch.Tensor,
) -> torch.Tensor:
    """Masked-layout FP8 grouped GEMM (decode, DeepGEMM's masked layout).

    Args:
        x: ``[E, C, K]`` float8_e4m3fn; rows past each expert's count are never read.
        x_scale: ``[E, C, cdiv(K, 128)]`` fp32 (padding rows' scales are never read either).
        counts: ``[E]`` int valid rows per expert, read as ``clamp(count, 0, C)``.
        w: ``[E, N, K]`` float8_e4m3fn.
        w_scale: ``[E, cdiv(N, 128), cdiv(K, 128)]`` fp32.

    Returns:
        ``[E, C, N]`` bf16; padded rows are zero.
    """
    _check_scales(x, x_scale, w, w_scale)
    num_experts, capacity, k = x.shape
    if num_experts != w.shape[0] or counts.shape != (num_experts,):
        raise ValueError(f"x {tuple(x.shape)} / counts {tuple(counts.shape)} do not match "
                         f"weights {tuple(w.shape)}")
    n = w.shape[1]
    y = torch.empty(num_experts, capacity, n, dtype=OUT_DTYPE, device=x.device)
    launch_grouped_gemm(x.reshape(-1, k), w, y.view(-1, n), counts=counts, capacity=capacity,
                        x_scale=x_scale.reshape(num_experts * capacity, -1), w_scale=w_scale,
                        block_m=masked_block_m(capacity))
    return y


def dequantize_token_groups_reference(x: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] fp8, x_scale [..., cdiv(K, 128)] fp32 -> [..., K] fp32 = value * its group's
    scale."""
    scale = x_scale.repeat_interleave(FP8_GROUP, dim=-1)[..., : x.shape[-1]]
    return x.float() * scale


def dequantize_weight_blocks_reference(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """w [E, N, K] fp8, w_scale [E, cdiv(N, 128), cdiv(K, 128)] fp32 -> [E, N, K] fp32 =
    value * its 128 x 128 block's scale."""
    _, n, k = w.shape
    scale = w_scale.repeat_interleave(FP8_GROUP, dim=1).repeat_interleave(FP8_GROUP, dim=2)
    return w.float() * scale[:, :n, :k]


def grouped_gemm_fp8_contiguous_reference(
    x: torch.Tensor, x_scale: torch.Tensor, offsets: torch.Tensor,
    w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype = OUT_DTYPE,
) -> torch.Tensor:
    """Twin of :func:`grouped_gemm_fp8_contiguous`: dequantize, then per-expert fp32 matmul.
    ``out_dtype=torch.float32`` keeps the unrounded sums (for tests)."""
    return grouped_gemm_contiguous_reference(
        dequantize_token_groups_reference(x, x_scale), offsets,
        dequantize_weight_blocks_reference(w, w_scale), out_dtype)


def grouped_gemm_fp8_masked_reference(
    x: torch.Tensor, x_scale: torch.Tensor, counts: torch.Tensor,
    w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype = OUT_DTYPE,
) -> torch.Tensor:
    """Twin of :func:`grouped_gemm_fp8_masked`: dequantize, then per-expert fp32 matmul."""
    return grouped_gemm_masked_reference(
        dequantize_token_groups_reference(x, x_scale), counts,
        dequantize_weight_blocks_reference(w, w_scale), out_dtype)
