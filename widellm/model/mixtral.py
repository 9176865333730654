"""Mixtral: Llama attention with a sparse MoE block (``block_sparse_moe``): softmax router over
``num_local_experts``, top-k, renormalised weights, no shared expert."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from widellm.distributed.ep_context import ExpertParallelContext
from widellm.layers.moe.layer import FusedMoE
from widellm.layers.linear import Linear
from widellm.model.llama import (
    CausalLM, DecoderLayer, DecoderModel, LlamaAttention, llama_stacked_shards, make_rotary,
)


class MixtralMoeBlock(nn.Module):
    def __init__(self, cfg: Any, ep: ExpertParallelContext | None = None) -> None:
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        self.experts = FusedMoE(
            num_experts=cfg.num_local_experts,
            top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            scoring_func="softmax",
            renormalize=True,
            ep=ep,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.experts(x, self.gate(x).float())


class MixtralForCausalLM(CausalLM):
    def __init__(self, cfg: Any, ep: ExpertParallelContext | None = None) -> None:
        rope = make_rotary(cfg)

        def make_layer(i: int) -> nn.Module:
            return DecoderLayer(cfg, LlamaAttention(cfg, rope, qkv_bias=False),
                                MixtralMoeBlock(cfg, ep), mlp_name="block_sparse_moe")

        super().__init__(cfg, DecoderModel(cfg, make_layer))
        self.stacked_shards = llama_stacked_shards(cfg)
