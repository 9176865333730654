"""RMSNorm with the same arithmetic as Hugging Face's (variance in fp32, weight applied after
casting back), so fp32 outputs match the reference bit for bit. bf16/fp16 rows on CPU take the
fused kernel (same rounding steps, one pass)."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from widellm.ops.cpu_kernels import elementwise_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.variance_epsilon = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x, residual=None):
        """x [..., hidden] -> norm(x), same shape and dtype. With ``residual`` (same shape):
        the pre-norm residual stream, ``h = x + residual`` -> ``(norm(h), h)``, the add and the
        norm in one pass on the kernel path."""
        kernels = elementwise_kernels(x)
        if (kernels is None or x.dtype != self.weight.dtype or x.stride(-1) != 1
                or (residual is not None and residual.stride(-1) != 1)):
            return self.forward_reference(x, residual)
        rows = x.reshape(-1, x.shape[-1])
        if residual is None:
            return kernels.rms_norm(rows, self.weight, self.variance_epsilon).view(x.shape)
        out, h = kernels.fused_add_rms_norm(rows, residual.reshape(-1, x.shape[-1]),
                                            self.weight, self.variance_epsilon)
        return out.view(x.shape), h.view(x.shape)

    def forward_reference(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            h = x + residual
            return self.forward_reference(h), h
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)
