"""Rotary position embeddings with a precomputed cos/sin table.

Frequencies come from transformers' own rope initialisers (default, linear, dynamic, yarn,
llama3, longrope), so scaled variants match the checkpoint's reference implementation.
Two layouts: ``neox`` rotates the two halves of the head (Llama, Qwen, Mixtral); ``interleaved``
rotates adjacent pairs (DeepSeek) and returns them de-interleaved, as HF does, which leaves
every q.k product unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from widellm.ops.cpu_kernels import elementwise_kernels


def rope_parameters(hf_config: Any) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return 1.0 / (base ** exponents)


class RotaryEmbedding(nn.Module):
    """``forward(positions [T], q [T, H, R], k [T, Hk, R]) -> (q, k)`` rotated, same shapes.
    R is the rotary dimension (the whole head, or DeepSeek's ``qk_rope_head_dim``)."""

    def __init__(self, hf_config: Any, rotary_dim: int, max_position: int, style: str = "neox"):
        super().__init__()
        if style not in ("neox", "interleaved"):
            raise ValueError(f"rotary style must be 'neox' or 'interleaved', got {style!r}")
        self.style = style
        self.rotary_dim = rotary_dim
        params = rope_parameters(hf_config)
        rope_type = params["rope_type"]
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(params["rope_theta"], rotary_dim), 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        if inv_freq.numel() * 2 != rotary_dim:
            raise ValueError(f"rope gives {inv_freq.numel() * 2} dims, model needs {rotary_dim}")
        pos = torch.arange(max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """On CPU (:func:`elementwise_kernels`): the fused kernel, one call per tensor instead
        of ~10 ops, rounding where the reference rounds (bit-equal in bf16); else
        :meth:`forward_reference`."""
        kernels = elementwise_kernels(q)
        if kernels is None or q.stride(-1) != 1 or k.stride(-1) != 1:
            return self.forward_reference(positions, q, k)
        interleaved = self.style == "interleaved"
        return (
            kernels.rotary_embedding(positions, q, self.cos_cache, self.sin_cache, interleaved),
            kernels.rotary_embedding(positions, k, self.cos_cache, self.sin_cache, interleaved),
        )

    def forward_reference(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)  # [T, 1, R]
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.style == "interleaved":
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
