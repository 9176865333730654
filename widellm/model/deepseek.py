"""DeepSeek-V2 / V3: Multi-head Latent Attention and DeepSeekMoE.

Read top-down: config fields -> MLA attention -> MoE (router, routed and shared experts) ->
decoder layer -> model. T = tokens in the flattened batch, H = hidden_size, n = heads.

Routing (DeepSeek-V3 paper, sec. 2.1.2): s = sigmoid(x W_gate^T) per expert; selection uses
s + b (the score-correction bias, a load-balancing term learned without auxiliary loss) inside
the ``topk_group`` best of ``n_group`` groups (group score = sum of its two best biased scores);
the gate values are the *unbiased* s of the chosen experts, renormalised if ``norm_topk_prob``
and multiplied by ``routed_scaling_factor``. DeepSeek-V2 uses softmax scores and the group's
best score instead. Layers before ``first_k_dense_replace`` use a dense MLP.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from widellm.layers.linear import Linear
from widellm.layers.mla import MLAAttention
from widellm.distributed.ep_context import ExpertParallelContext
from widellm.layers.moe.layer import FusedMoE
from widellm.layers.norm import RMSNorm
from widellm.layers.rotary import RotaryEmbedding, rope_parameters
from widellm.model.llama import CausalLM, DecoderLayer, DecoderModel, LlamaMLP
from widellm.model.weight_utils import GATE_UP_SHARDS


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(cfg: Any) -> float:
    """1/sqrt(qk_head_dim), times mscale^2 under YaRN (the long-context attention temperature)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = rope_parameters(cfg)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale *= m * m
    return scale


class DeepseekMLAAttention(nn.Module):
    """x [T, H] -> [T, H].

    q = W_q x (or W_qb norm(W_qa x) with ``q_lora_rank``), split per head into q_nope | q_pe;
    [c_kv | k_pe] = W_kva x; c_kv is normalised; q_pe and k_pe get rotary embeddings. The cache
    keeps c_kv and k_pe; ``kv_b_proj`` expands c_kv into per-head k_nope and v when needed."""

    def __init__(self, cfg: Any, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        bias = bool(getattr(cfg, "attention_bias", False))
        h, n = cfg.hidden_size, self.num_heads
        if self.q_lora_rank is None:
            self.q_proj = Linear(h, n * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(self.q_lora_rank, n * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(
            self.kv_lora_rank, n * (self.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = Linear(n * cfg.v_head_dim, h, bias=bias)
        self.rotary_emb = rotary_emb
        self.mla = MLAAttention(
            n, self.qk_nope_head_dim, self.qk_rope_head_dim, cfg.v_head_dim, self.kv_lora_rank,
            scale=mla_softmax_scale(cfg), kv_b_proj=self.kv_b_proj,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        out = self.mla(torch.cat([q_nope, q_pe], dim=-1), kv_c, k_pe.squeeze(1))
        return self.o_proj(out.flatten(1))


class DeepseekGate(nn.Module):
    """Router weights, kept in fp32 as the reference does: [E, H] and, for V3, the [E]
    score-correction bias (selection only)."""

    def __init__(self, hidden_size: int, num_experts: int, with_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32)) if with_bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> router logits [T, E] fp32."""
        return F.linear(x.float(), self.weight)


class DeepseekMoE(nn.Module):
    """x [T, H] -> routed experts (top-k of n_routed_experts) + shared experts, [T, H]."""

    def __init__(self, cfg: Any, is_v3: bool, ep: ExpertParallelContext | None = None) -> None:
        super().__init__()
        sigmoid = is_v3 or getattr(cfg, "scoring_func", "softmax") == "sigmoid"
        topk_method = getattr(cfg, "topk_method", "noaux_tc" if is_v3 else "greedy")
        grouped = topk_method in ("noaux_tc", "group_limited_greedy")
        renormalize = bool(getattr(cfg, "norm_topk_prob", False))
        scaling = getattr(cfg, "routed_scaling_factor", 1.0) or 1.0
        if not is_v3 and renormalize:
            scaling = 1.0  # DeepSeek-V2 scales only un-normalised weights
        self.gate = DeepseekGate(cfg.hidden_size, cfg.n_routed_experts, with_bias=is_v3)
        self.experts = FusedMoE(
            num_experts=cfg.n_routed_experts,
            top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            scoring_func="sigmoid" if sigmoid else "softmax",
            renormalize=renormalize,
            num_expert_group=cfg.n_group if grouped else None,
            topk_group=cfg.topk_group if grouped else None,
            group_score="top2_sum" if topk_method == "noaux_tc" else "max",
            e_score_correction_bias=self.gate.e_score_correction_bias,
            routed_scaling_factor=scaling,
            ep=ep,
        )
        n_shared = getattr(cfg, "n_shared_experts", 0) or 0
        self.shared_experts = (
            LlamaMLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared) if n_shared else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The shared experts run while the routed tokens travel (FusedMoE.forward).
        return self.experts(x, self.gate(x), shared_experts=self.shared_experts)


def _is_moe_layer(cfg: Any, i: int) -> bool:
    freq = getattr(cfg, "moe_layer_freq", 1) or 1
    return (
        bool(getattr(cfg, "n_routed_experts", None))
        and i >= getattr(cfg, "first_k_dense_replace", 0)
        and i % freq == 0
    )


class DeepseekV2ForCausalLM(CausalLM):
    is_v3 = False

    def __init__(self, cfg: Any, ep: ExpertParallelContext | None = None) -> None:
        interleaved = getattr(cfg, "rope_interleave", True)
        rope = RotaryEmbedding(cfg, cfg.qk_rope_head_dim, cfg.max_position_embeddings,
                               style="interleaved" if interleaved else "neox")

        def make_layer(i: int) -> nn.Module:
            mlp = (DeepseekMoE(cfg, self.is_v3, ep) if _is_moe_layer(cfg, i)
                   else LlamaMLP(cfg.hidden_size, cfg.intermediate_size))
            return DecoderLayer(cfg, DeepseekMLAAttention(cfg, rope), mlp)

        super().__init__(cfg, DecoderModel(cfg, make_layer))
        self.stacked_shards = GATE_UP_SHARDS
        # Multi-token-prediction layers sit after the last decoder layer; serving skips them.
        n = cfg.num_hidden_layers
        extra = getattr(cfg, "num_nextn_predict_layers", 0) or 0
        self.skip_weights = self.skip_weights + tuple(
            rf"^model\.layers\.{i}\." for i in range(n, n + extra)
        )


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    is_v3 = True
