"""Llama-family decoder (Llama, Qwen2; the attention and block reused by Mixtral and Qwen-MoE).

Top-down: config -> attention -> MLP -> decoder layer -> model -> causal-LM head. Shapes use
T = tokens in the flattened batch, H = hidden size. Checkpoint names load unchanged; the
q/k/v and gate/up projections are fused into one matmul each at load time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from widellm.forward_context import current_forward_context
from widellm.layers.activation import SiluAndMul
from widellm.layers.attention import Attention
from widellm.layers.linear import Linear
from widellm.layers.norm import RMSNorm
from widellm.layers.rotary import RotaryEmbedding
from widellm.model.weight_utils import (
    GATE_UP_SHARDS, StackedShard, check_all_loaded, load_weights,
)


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary embeddings; optional q/k/v bias (Qwen2) and per-head
    q/k RMSNorm before rotary (Qwen3)."""

    def __init__(
        self, cfg: Any, rotary_emb: RotaryEmbedding, qkv_bias: bool, qk_norm: bool = False,
        o_bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary_emb  # one cos/sin table shared by all layers
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              scale=self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions [T], x [T, H] -> [T, H]."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v).flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), with the residual stream
    carried beside the output (see :meth:`forward`). The attention and MLP modules are
    supplied by the model family."""

    def __init__(self, cfg: Any, self_attn: nn.Module, mlp: nn.Module, mlp_name: str = "mlp"):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self_attn
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)  # checkpoint name: "mlp" or Mixtral's "block_sparse_moe"

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] is the previous layer's output and ``residual`` [T, H] the stream it adds
        to (None in the first layer, whose input is the stream itself). Returns this layer's
        (MLP output, residual stream); each add is fused into the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h), residual)
        return getattr(self, self.mlp_name)(h), residual


class DecoderModel(nn.Module):
    """Embedding -> layers -> final norm. ``make_layer(i)`` builds layer i.

    ``fused_decode`` (set by the loader where it applies, see
    :mod:`widellm.model.fused_decode`) runs all layers of a decode-only batch in one kernel
    call; the loop over the layers is its reference twin and runs everything else."""

    def __init__(self, cfg: Any, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused_decode = None  # FusedDecode | None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        ctx = current_forward_context() if self.fused_decode is not None else None
        if ctx is not None and self.fused_decode.applies(ctx, x):
            x, residual = self.fused_decode(ctx, positions, x)
        else:
            for layer in self.layers:
                x, residual = layer(positions, x, residual)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class CausalLM(nn.Module):
    """The interface every model family implements for the model runner:
    ``forward(input_ids [T], positions [T]) -> hidden [T, H]``,
    ``compute_logits(hidden [N, H]) -> [N, vocab]`` in the model's dtype (the sampler widens to
    fp32 where it computes; greedy argmax needs no [N, vocab] fp32 copy), ``load_weights``."""

    stacked_shards: tuple[StackedShard, ...] = ()
    skip_weights: tuple[str, ...] = (r"rotary_emb\.inv_freq",)

    def __init__(self, cfg: Any, model: nn.Module) -> None:
        super().__init__()
        self.config = cfg
        self.model = model
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loaded = load_weights(self, weights, self.stacked_shards, self.skip_weights)
        check_all_loaded(self, loaded, tied=["lm_head.weight"] if self.tie_word_embeddings else [])


def llama_stacked_shards(cfg: Any) -> tuple[StackedShard, ...]:
    """q/k/v rows of qkv_proj and gate/up rows of every dense gate_up_proj."""
    hd = head_dim_of(cfg)
    q = cfg.num_attention_heads * hd
    kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * hd
    return (
        StackedShard("qkv_proj", "q_proj", 0),
        StackedShard("qkv_proj", "k_proj", q),
        StackedShard("qkv_proj", "v_proj", q + kv),
        *GATE_UP_SHARDS,
    )


def make_rotary(cfg: Any) -> RotaryEmbedding:
    return RotaryEmbedding(cfg, head_dim_of(cfg), cfg.max_position_embeddings)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: Any) -> None:
        bias = bool(getattr(cfg, "attention_bias", False))
        rope = make_rotary(cfg)

        def make_layer(i: int) -> nn.Module:
            return DecoderLayer(cfg, LlamaAttention(cfg, rope, qkv_bias=bias, o_bias=bias),
                                LlamaMLP(cfg.hidden_size, cfg.intermediate_size))

        super().__init__(cfg, DecoderModel(cfg, make_layer))
        self.stacked_shards = llama_stacked_shards(cfg)


class Qwen2ForCausalLM(CausalLM):
    def __init__(self, cfg: Any) -> None:
        rope = make_rotary(cfg)

        def make_layer(i: int) -> nn.Module:
            return DecoderLayer(cfg, LlamaAttention(cfg, rope, qkv_bias=True),
                                LlamaMLP(cfg.hidden_size, cfg.intermediate_size))

        super().__init__(cfg, DecoderModel(cfg, make_layer))
        self.stacked_shards = llama_stacked_shards(cfg)
