"""Gated activations used by MLPs and MoE experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from widellm.ops.cpu_kernels import elementwise_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate, ``[..., 2 * I] -> [..., I]``: the fused CPU kernel where it applies
    (:func:`elementwise_kernels`; one pass instead of two ops and a temporary), else
    :func:`silu_and_mul_reference`."""
    kernels = elementwise_kernels(x)
    if kernels is None:
        return silu_and_mul_reference(x)
    if x.dim() == 2 and x.stride(-1) == 1:
        return kernels.silu_and_mul(x)
    if x.is_contiguous():  # e.g. the masked experts' [E, P, 2I]
        return kernels.silu_and_mul(x.view(-1, x.shape[-1])).view(*x.shape[:-1], -1)
    return silu_and_mul_reference(x)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: ``silu(gate) * up`` with the gate in the first half.

    Args:
        x: ``[..., 2 * I]``, the output of a fused gate/up projection laid out as
            ``[gate (w1) | up (w3)]``.

    Returns:
        ``[..., I]`` in the dtype of ``x``.
    """
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(nn.Module):
    """Module form of :func:`silu_and_mul`: ``[T, 2I] -> [T, I]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
