"""Gated activations used by MLPs and MoE experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
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
