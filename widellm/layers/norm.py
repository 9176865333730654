"""RMSNorm with the same arithmetic as Hugging Face's (variance in fp32, weight applied after
casting back), so fp32 outputs match the reference bit for bit. bf16/fp16 rows on CPU take the
fused kernel (same rounding steps, one pass)."""

from __future__ import annotations

import torch
from torch import nn

from widellm.ops.cpu_kernels import reduced_precision_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> same shape and dtype."""
        kernels = reduced_precision_kernels(x)
        if kernels is None or x.dtype != self.weight.dtype or x.stride(-1) != 1:
            return self.forward_reference(x)
        return kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight,
                                self.variance_epsilon).view(x.shape)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)
