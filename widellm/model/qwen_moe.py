"""Qwen2-MoE and Qwen3-MoE: Llama-style attention (Qwen2: q/k/v bias; Qwen3: per-head q/k
RMSNorm) with a sparse MoE block: softmax router over ``num_experts``, top-k, optional
renormalisation, and (Qwen2-MoE) a shared expert scaled by a sigmoid gate."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from widellm.distributed.ep_context import ExpertParallelContext
from widellm.layers.moe.layer import FusedMoE
from widellm.layers.linear import Linear
from widellm.model.llama import (
    CausalLM, DecoderLayer, DecoderModel, LlamaAttention, LlamaMLP, llama_stacked_shards,
    make_rotary,
)


class QwenMoeBlock(nn.Module):
    """x [T, H] -> [T, H]: routed experts (+ gated shared expert when configured)."""

    def __init__(self, cfg: Any, ep: ExpertParallelContext | None = None) -> None:
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            scoring_func="softmax",
            renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
            ep=ep,
        )
        shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = LlamaMLP(cfg.hidden_size, shared) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The shared expert runs while the routed tokens travel (FusedMoE.forward).
        shared = self._gated_shared_expert if self.shared_expert is not None else None
        return self.experts(x, self.gate(x).float(), shared_experts=shared)

    def _gated_shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def _is_sparse_layer(cfg: Any, i: int) -> bool:
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (
        i not in (getattr(cfg, "mlp_only_layers", None) or [])
        and cfg.num_experts > 0
        and (i + 1) % step == 0
    )


class _QwenMoeForCausalLM(CausalLM):
    qkv_bias = False
    qk_norm = False

    def __init__(self, cfg: Any, ep: ExpertParallelContext | None = None) -> None:
        rope = make_rotary(cfg)

        def make_layer(i: int) -> nn.Module:
            attn = LlamaAttention(cfg, rope, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)
            mlp = (QwenMoeBlock(cfg, ep) if _is_sparse_layer(cfg, i)
                   else LlamaMLP(cfg.hidden_size, cfg.intermediate_size))
            return DecoderLayer(cfg, attn, mlp)

        super().__init__(cfg, DecoderModel(cfg, make_layer))
        self.stacked_shards = llama_stacked_shards(cfg)


class Qwen2MoeForCausalLM(_QwenMoeForCausalLM):
    qkv_bias = True


class Qwen3MoeForCausalLM(_QwenMoeForCausalLM):
    qk_norm = True
