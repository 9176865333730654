"""Matmul weights and forward FLOPs per token from a transformers config (any attribute-style
config works): what the presets' descriptions, ``bench``'s MFU and the simulator's model
shapes count."""

from __future__ import annotations

from typing import Any


def moe_layer_ids(config: Any) -> set[int]:
    """Indices of the layers whose MLP is a routed mixture of experts."""
    layers = range(config.num_hidden_layers)
    if getattr(config, "n_routed_experts", None):  # DeepSeek V2/V3
        first_dense = getattr(config, "first_k_dense_replace", 0) or 0
        freq = getattr(config, "moe_layer_freq", 1) or 1
        return {i for i in layers if i >= first_dense and i % freq == 0}
    if getattr(config, "num_local_experts", None):  # Mixtral
        return set(layers)
    if getattr(config, "num_experts", None):  # Qwen2/Qwen3-MoE
        only_dense = set(getattr(config, "mlp_only_layers", None) or [])
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return {i for i in layers if i not in only_dense and (i + 1) % step == 0}
    return set()


def _attention_params(config: Any) -> int:
    """Matmul weights of one attention block (MLA or grouped-query)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None):  # MLA
        qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        q_rank = getattr(config, "q_lora_rank", None)
        q = hidden * q_rank + q_rank * heads * qk_dim if q_rank else hidden * heads * qk_dim
        kv_a = hidden * (config.kv_lora_rank + config.qk_rope_head_dim)
        kv_b = config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
        return q + kv_a + kv_b + heads * config.v_head_dim * hidden
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def _gated_mlp_params(hidden: int, intermediate: int) -> int:
    """gate, up and down projections of one SwiGLU MLP."""
    return 3 * hidden * intermediate


def _moe_active_params(config: Any) -> int:
    """Matmul weights one token touches in an MoE block: router, its top-k, shared experts."""
    hidden = config.hidden_size
    num_experts = (
        getattr(config, "n_routed_experts", None)
        or getattr(config, "num_local_experts", None)
        or config.num_experts
    )
    expert_size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    active = hidden * num_experts
    active += config.num_experts_per_tok * _gated_mlp_params(hidden, expert_size)
    active += (getattr(config, "n_shared_experts", 0) or 0) * _gated_mlp_params(hidden, expert_size)
    shared_size = getattr(config, "shared_expert_intermediate_size", 0) or 0
    if shared_size:  # Qwen2-MoE: one shared expert with a scalar sigmoid gate
        active += _gated_mlp_params(hidden, shared_size) + hidden
    return active


def flops_per_token(config: Any) -> float:
    """Forward FLOPs per token: 2 x the matmul weights a token is multiplied with.

    Counts attention projections, dense or MoE MLPs (router, the top-k routed experts and any
    shared experts) and the lm_head (also when tied to the embeddings); excludes the embedding
    lookup, norms, biases and the context-dependent attention score/value products.

    Args:
        config: a transformers config object (any attribute-style config works).
    """
    moe_layers = moe_layer_ids(config)
    dense_mlp = _gated_mlp_params(config.hidden_size, config.intermediate_size)
    params = config.num_hidden_layers * _attention_params(config)
    if moe_layers:
        params += len(moe_layers) * _moe_active_params(config)
    params += (config.num_hidden_layers - len(moe_layers)) * dense_mlp
    params += config.hidden_size * config.vocab_size
    return 2.0 * params
