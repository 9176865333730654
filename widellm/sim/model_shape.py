"""A model's shape as the cost model needs it: parameter counts per GEMM group, attention FLOPs
per (query, key) pair and KV bytes per token, read from a HF config (dict or object).

Families: DeepSeek-V2/V3 (MLA + MoE; ``num_nextn_predict_layers`` MTP layers are not counted,
``num_hidden_layers`` excludes them), Qwen2/3-MoE, Mixtral, and dense Llama-style models (GQA).

Shapes, with H = hidden, n_h = heads:

* MLA (DeepSeek): q_a [H, q_lora], q_b [q_lora, n_h (nope + rope)] (or q [H, n_h (nope+rope)]
  without q_lora), kv_a [H, kv_lora + rope], kv_b [kv_lora, n_h (nope + v)], o [n_h v, H].
  Decode runs absorbed: kv_b's halves multiply the query (W_UK) and the output (W_UV) per row,
  so its FLOPs per row are the same 2 * params as any projection, and attention reads the
  latent cache (kv_lora + rope values per token) with 2 n_h (kv_lora + rope) + 2 n_h kv_lora
  FLOPs per (row, key) pair. Prefill runs expanded: kv_b expands every key's latent (2 * kv_b
  params per context token) and attention is MHA with 2 n_h (nope + rope) + 2 n_h v FLOPs per
  pair.
* GQA: qkv [H, (n_h + 2 n_kv) d], o [n_h d, H]; 4 n_h d FLOPs per pair; KV 2 n_kv d values per
  token.
* MLP: gate/up/down, 3 H I params (dense layers, each routed expert with I = moe_intermediate,
  shared experts with their intermediate size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4, "float32": 4, "bfloat16": 2,
               "float16": 2}


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        value = cfg.get(name, default)
    else:
        value = getattr(cfg, name, default)
    return default if value is None else value


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Counts the cost model prices (per layer unless said otherwise).

    Attributes:
        family: "deepseek_mla", "moe_gqa" or "dense_gqa".
        hidden, vocab: sizes.
        num_layers, num_moe_layers: decoder layers, of which MoE (the rest are dense MLP).
        attn_proj_params: linear weights of one layer's attention projections, absorbed or
            expanded alike (kv_b included).
        attn_bf16_params: the part of ``attn_proj_params`` that stays BF16 under FP8 weights
            (MLA's kv_b, run as batched matmuls in the absorbed form).
        kv_b_params: MLA's kv_b (expands each context token's latent in prefill); 0 for GQA.
        flops_per_pair_decode, flops_per_pair_prefill: attention FLOPs per (row, key) pair.
        kv_values_per_token: cached values per token per layer.
        dense_mlp_params: MLP weights of one dense layer.
        shared_expert_params: shared-expert weights of one MoE layer.
        expert_params: weights of one routed expert.
        router_params: one MoE layer's gate.
        n_routed_experts, top_k: routing.
        lm_head_params: output projection.
    """

    family: str
    hidden: int
    vocab: int
    num_layers: int
    num_moe_layers: int
    attn_proj_params: int
    attn_bf16_params: int
    kv_b_params: int
    flops_per_pair_decode: int
    flops_per_pair_prefill: int
    kv_values_per_token: int
    dense_mlp_params: int
    shared_expert_params: int
    expert_params: int
    router_params: int
    n_routed_experts: int
    top_k: int
    lm_head_params: int

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """KV-cache bytes of one token over all layers."""
        return self.kv_values_per_token * DTYPE_BYTES[kv_dtype] * self.num_layers

    def active_params_per_token(self) -> int:
        """Weights one token multiplies (the usual "active parameters", without embeddings)."""
        per_moe = self.shared_expert_params + self.top_k * self.expert_params + self.router_params
        return (self.num_layers * self.attn_proj_params + self.num_dense_layers
                * self.dense_mlp_params + self.num_moe_layers * per_moe + self.lm_head_params)

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelShape":
        """Read a HF ``config.json`` (dict) or ``PretrainedConfig``."""
        hidden = int(_get(cfg, "hidden_size"))
        vocab = int(_get(cfg, "vocab_size"))
        layers = int(_get(cfg, "num_hidden_layers"))
        heads = int(_get(cfg, "num_attention_heads"))
        n_experts = int(_get(cfg, "n_routed_experts", _get(cfg, "num_experts",
                                                            _get(cfg, "num_local_experts", 0))))
        top_k = int(_get(cfg, "num_experts_per_tok", 0)) if n_experts else 0
        moe_inter = int(_get(cfg, "moe_intermediate_size", _get(cfg, "intermediate_size", 0)))
        dense_inter = int(_get(cfg, "intermediate_size", 0))
        # Tied or not, the output projection multiplies H x V weights per sampled row.
        lm_head = hidden * vocab
        if _get(cfg, "kv_lora_rank", 0):
            attn = _mla(cfg, hidden, heads)
            moe_layers = _deepseek_moe_layers(cfg, layers) if n_experts else 0
            shared = 3 * hidden * moe_inter * int(_get(cfg, "n_shared_experts", 0))
            family = "deepseek_mla"
        else:
            attn = _gqa(cfg, hidden, heads)
            moe_layers = _qwen_moe_layers(cfg, layers) if n_experts else 0
            shared = 3 * hidden * int(_get(cfg, "shared_expert_intermediate_size", 0))
            family = "moe_gqa" if n_experts else "dense_gqa"
        return cls(
            family=family, hidden=hidden, vocab=vocab, num_layers=layers,
            num_moe_layers=moe_layers, **attn,
            dense_mlp_params=3 * hidden * dense_inter,
            shared_expert_params=shared,
            expert_params=3 * hidden * moe_inter if n_experts else 0,
            router_params=hidden * n_experts,
            n_routed_experts=n_experts, top_k=top_k, lm_head_params=lm_head,
        )


def _mla(cfg: Any, hidden: int, heads: int) -> dict:
    q_lora = int(_get(cfg, "q_lora_rank", 0))
    kv_lora = int(_get(cfg, "kv_lora_rank"))
    nope = int(_get(cfg, "qk_nope_head_dim"))
    rope = int(_get(cfg, "qk_rope_head_dim"))
    v = int(_get(cfg, "v_head_dim"))
    q_dim = heads * (nope + rope)
    q_params = hidden * q_lora + q_lora * q_dim if q_lora else hidden * q_dim
    kv_b = kv_lora * heads * (nope + v)
    proj = q_params + hidden * (kv_lora + rope) + kv_b + heads * v * hidden
    return dict(
        attn_proj_params=proj, attn_bf16_params=kv_b, kv_b_params=kv_b,
        flops_per_pair_decode=2 * heads * (kv_lora + rope) + 2 * heads * kv_lora,
        flops_per_pair_prefill=2 * heads * (nope + rope) + 2 * heads * v,
        kv_values_per_token=kv_lora + rope,
    )


def _gqa(cfg: Any, hidden: int, heads: int) -> dict:
    kv_heads = int(_get(cfg, "num_key_value_heads", heads))
    head_dim = int(_get(cfg, "head_dim", hidden // heads))
    proj = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    pair = 4 * heads * head_dim
    return dict(
        attn_proj_params=proj, attn_bf16_params=0, kv_b_params=0,
        flops_per_pair_decode=pair, flops_per_pair_prefill=pair,
        kv_values_per_token=2 * kv_heads * head_dim,
    )


def _deepseek_moe_layers(cfg: Any, layers: int) -> int:
    first_dense = int(_get(cfg, "first_k_dense_replace", 0))
    freq = int(_get(cfg, "moe_layer_freq", 1)) or 1
    return sum(1 for i in range(first_dense, layers) if i % freq == 0)


def _qwen_moe_layers(cfg: Any, layers: int) -> int:
    step = int(_get(cfg, "decoder_sparse_step", 1)) or 1
    dense_only = set(_get(cfg, "mlp_only_layers", []) or [])
    return sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
