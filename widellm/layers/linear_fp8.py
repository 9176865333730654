"""The FP8 block-quantized linear method: DeepSeek-V3's checkpoint format kept as it is.

The layer holds ``weight`` ``[out, in]`` float8_e4m3fn and ``weight_scale_inv`` ``[ceil(out /
128), ceil(in / 128)]`` fp32, one scale per 128 x 128 block (the checkpoint's own tensors, so
the weights take half the memory of bf16). ``apply`` computes by one of two kernels:

* ``w8a8`` (CUDA): the activations are quantized per token and 128-column group to FP8
  (:func:`~widellm.ops.triton_silu_mul_quant.per_token_group_quant`) and multiplied by the FP8
  weight with both scales applied in the GEMM's inner loop (the Triton grouped GEMM with one
  group): DeepSeek's own inference recipe (DeepGEMM's W8A8 with block scales).
  :func:`w8a8_linear_reference` is its torch twin.
* ``dequant`` (CPU, the reference): the weight is dequantized to x's dtype per call and run by
  ``F.linear``; fp32 results equal those of a checkpoint dequantized at load, bit for bit.

On CPU the loader dequantizes FP8 checkpoints at load instead (plain or oneDNN-packed linears),
so this method only runs there in tests; ``kernel`` pins one of the two for them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from widellm.layers.linear_method import LinearMethod

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
SCALE_INV_PARAM = "weight_scale_inv"
# The W8A8 kernels' activation group and weight block edge (DeepGEMM's, DeepSeek-V3's).
W8A8_BLOCK = (128, 128)
KERNELS = ("auto", "w8a8", "dequant")


def dequantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor,
                      block_size: tuple[int, int]) -> torch.Tensor:
    """w ``[..., out, in]`` fp8, scale_inv ``[..., ceil(out/bo), ceil(in/bi)]`` -> ``[..., out,
    in]`` fp32 = each value times its block's scale (the product DeepSeek's ``weight_dequant``
    takes); leading dims such as stacked experts' pass through."""
    rows, cols = block_size
    scale = scale_inv.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)
    return w.to(SCALE_DTYPE) * scale[..., : w.shape[-2], : w.shape[-1]]


def w8a8_linear(x2: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x2 ``[M, in]`` -> ``[M, out]`` bf16 through the Triton kernels (CUDA, or CPU under
    ``TRITON_INTERPRET=1``)."""
    from widellm.ops.triton_grouped_gemm_fp8 import grouped_gemm_fp8_contiguous
    from widellm.ops.triton_silu_mul_quant import per_token_group_quant

    q, q_scale = per_token_group_quant(x2)
    offsets = torch.tensor([0, x2.shape[0]], dtype=torch.int64, device=x2.device)
    return grouped_gemm_fp8_contiguous(q, q_scale, offsets, w[None], scale_inv[None])


def w8a8_linear_reference(x2: torch.Tensor, w: torch.Tensor,
                          scale_inv: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`w8a8_linear` in plain torch: the same activation quantization, then an
    fp32 matmul of the dequantized operands, rounded once to bf16."""
    from widellm.ops.triton_grouped_gemm_fp8 import grouped_gemm_fp8_contiguous_reference
    from widellm.ops.triton_silu_mul_quant import per_token_group_quant_reference

    q, q_scale = per_token_group_quant_reference(x2)
    offsets = torch.tensor([0, x2.shape[0]], dtype=torch.int64, device=x2.device)
    return grouped_gemm_fp8_contiguous_reference(q, q_scale, offsets, w[None], scale_inv[None])


def check_kernel(kernel: str, block_size: tuple[int, int]) -> None:
    """Raise ValueError unless ``kernel`` (one of KERNELS) can run ``block_size`` scales."""
    if kernel not in KERNELS:
        raise ValueError(f"FP8 kernel {kernel!r}: expected one of {KERNELS}")
    if kernel == "w8a8" and tuple(block_size) != W8A8_BLOCK:
        raise ValueError(f"the w8a8 kernel needs {W8A8_BLOCK} blocks, not {block_size}")


def choose_kernel(kernel: str, block_size: tuple[int, int], x: torch.Tensor) -> str:
    """The kernel for activations ``x``: a pinned one, or for "auto" w8a8 on CUDA with
    128 x 128 blocks, else dequant."""
    if kernel != "auto":
        return kernel
    return "w8a8" if x.is_cuda and tuple(block_size) == W8A8_BLOCK else "dequant"


class Fp8BlockLinearMethod(LinearMethod):
    """FP8 weights with per-block scales; see the module docstring.

    Args:
        block_size: (rows, columns) per scale, from the checkpoint's quantization_config.
        kernel: "auto" (w8a8 on CUDA when the blocks are 128 x 128, else dequant), or one of
            them pinned (tests).
    """

    name = "fp8_block"

    def __init__(self, block_size: tuple[int, int], kernel: str = "auto") -> None:
        check_kernel(kernel, block_size)
        self.block_size = tuple(block_size)
        self.kernel = kernel
        # The model dtype, which dense_weight() returns (set when the FP8 weight replaces it).
        self.dtype = torch.get_default_dtype()

    def create_weights(self, layer: nn.Linear) -> None:
        out_features, in_features = layer.out_features, layer.in_features
        device = layer.weight.device
        self.dtype = layer.weight.dtype
        grid = (math.ceil(out_features / self.block_size[0]),
                math.ceil(in_features / self.block_size[1]))
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
            requires_grad=False)
        layer.register_parameter(SCALE_INV_PARAM, nn.Parameter(
            torch.empty(grid, dtype=SCALE_DTYPE, device=device), requires_grad=False))

    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        scale_inv = getattr(layer, SCALE_INV_PARAM)
        if choose_kernel(self.kernel, self.block_size, x) == "dequant":
            w = dequantize_blocks(layer.weight, scale_inv, self.block_size).to(x.dtype)
            return F.linear(x, w, layer.bias)
        x2 = x.reshape(-1, layer.in_features)
        y = w8a8_linear(x2, layer.weight, scale_inv)
        if layer.bias is not None:
            y = y + layer.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)

    def dense_weight(self, layer: nn.Linear) -> torch.Tensor:
        scale_inv = getattr(layer, SCALE_INV_PARAM)
        return dequantize_blocks(layer.weight, scale_inv, self.block_size).to(self.dtype)
