"""Routed experts with DeepSeek-V3's FP8 block-quantized weights kept as they are.

The checkpoint stores each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` as float8_e4m3fn
with one fp32 ``weight_scale_inv`` per 128 x 128 block (``model/fp8.py``). A :class:`FusedMoE`
given :class:`Fp8BlockExperts` before loading holds them stacked like its plain weights:

* ``w13_weight`` ``[E_local, 2I, H]`` float8, ``w13_weight_scale_inv`` ``[E_local, 2I / bo,
  cdiv(H, bi)]``: gate's block rows first, then up's. Stacking needs ``I % bo == 0`` (up's
  first row starts a block); DeepSeek-V3's ``moe_intermediate_size`` 2,048 is, and the loader
  dequantizes the experts of a model where it is not (``fp8_experts_supported``).
* ``w2_weight`` ``[E_local, H, I]`` float8, ``w2_weight_scale_inv`` ``[E_local, cdiv(H, bo),
  cdiv(I, bi)]``.

``apply`` computes by one of two kernels, as the FP8 linears do (``layers/linear_fp8.py``):

* ``w8a8`` (CUDA): rows sorted by expert (contiguous layout), activations quantized per token
  and 128-column group, the Triton FP8 grouped GEMM for w13, the fused SiLU-and-mul + quant,
  the grouped GEMM for w2, rows put back in order
  (:func:`~widellm.layers.moe.experts_triton.triton_experts_forward` with the scales; its
  ``reference=True`` runs the same sequence on the ops' torch twins).
* ``dequant`` (CPU, the reference): the weights are dequantized to the rows' dtype per call and
  run by :func:`~widellm.layers.moe.experts.experts_forward`; fp32 results equal those of a
  checkpoint dequantized at load, bit for bit.

EPLB moves the scales between ranks with the weights (``FusedMoE.expert_parameters``). The w8a8 path
is the contiguous layout only (the sort and the kernels need no host sync, so a decode step can
be captured in a CUDA graph); the masked layout DeepEP-style fixed-capacity decode fills is the
kernels' (``grouped_gemm_fp8_masked``) but not wired here yet.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from widellm.layers.linear_fp8 import (
    FP8_DTYPE, SCALE_DTYPE, check_kernel, choose_kernel, dequantize_blocks,
)
from widellm.layers.moe.experts import experts_forward
from widellm.layers.moe.experts_triton import triton_experts_forward

SCALE_SUFFIX = "_scale_inv"
W13_SCALE = "w13_weight" + SCALE_SUFFIX
W2_SCALE = "w2_weight" + SCALE_SUFFIX


def fp8_experts_supported(layer: nn.Module, block_size: tuple[int, int]) -> bool:
    """Whether ``layer`` (a FusedMoE) can hold its experts as FP8: up's rows start on a block
    boundary. (EPLB moves the scales with the weights: ``FusedMoE.expert_parameters``.)"""
    return layer.intermediate_size % block_size[0] == 0


def use_fp8_experts(model: nn.Module, names: Iterable[str], block_size: tuple[int, int],
                    kernel: str = "auto") -> int:
    """Give the FusedMoE layers ``names`` of ``model`` FP8 expert weights, before the
    checkpoint is loaded; returns how many layers changed."""
    modules = dict(model.named_modules())
    names = list(names)
    for name in names:
        method = Fp8BlockExperts(block_size, kernel)
        method.create_weights(modules[name])
        modules[name].experts_method = method
    return len(names)


class Fp8BlockExperts:
    """FP8 routed-expert weights with per-block scales; see the module docstring.

    Args:
        block_size: (rows, columns) per scale, from the checkpoint's quantization_config.
        kernel: "auto" (w8a8 on CUDA with 128 x 128 blocks, else dequant) or one pinned.
    """

    name = "fp8_block"

    def __init__(self, block_size: tuple[int, int], kernel: str = "auto") -> None:
        check_kernel(kernel, block_size)
        self.block_size = tuple(block_size)
        self.kernel = kernel

    def create_weights(self, layer: nn.Module) -> None:
        """Replace ``layer``'s expert weights with float8 ones plus their block scales."""
        if not fp8_experts_supported(layer, self.block_size):
            raise ValueError(f"these experts cannot stay FP8 (intermediate size "
                             f"{layer.intermediate_size}, blocks {self.block_size})")
        bo, bi = self.block_size
        for name in ("w13_weight", "w2_weight"):
            old = getattr(layer, name)
            experts, rows, cols = old.shape
            setattr(layer, name, nn.Parameter(
                torch.empty(experts, rows, cols, dtype=FP8_DTYPE, device=old.device),
                requires_grad=False))
            layer.register_parameter(name + SCALE_SUFFIX, nn.Parameter(
                torch.empty(experts, math.ceil(rows / bo), math.ceil(cols / bi),
                            dtype=SCALE_DTYPE, device=old.device), requires_grad=False))

    def scale_rows(self, layer: nn.Module, shard_id: str) -> slice:
        """The block rows of an expert's scale grid that checkpoint shard ``shard_id`` fills."""
        if shard_id == "w2":
            return slice(None)
        inter_blocks = layer.intermediate_size // self.block_size[0]
        return slice(0, inter_blocks) if shard_id == "w1" else slice(inter_blocks, None)

    def apply(self, layer: nn.Module, hidden: torch.Tensor,
              expert_ids: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` unweighted outputs of the local experts for the dispatched rows."""
        w13_scale, w2_scale = getattr(layer, W13_SCALE), getattr(layer, W2_SCALE)
        if choose_kernel(self.kernel, self.block_size, hidden) == "dequant":
            w13 = dequantize_blocks(layer.w13_weight, w13_scale, self.block_size)
            w2 = dequantize_blocks(layer.w2_weight, w2_scale, self.block_size)
            return experts_forward(hidden, expert_ids, w13.to(hidden.dtype), w2.to(hidden.dtype))
        return triton_experts_forward(hidden, expert_ids, layer.w13_weight, layer.w2_weight,
                                      w13_scale, w2_scale)
