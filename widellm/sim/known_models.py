"""Configs of published models the simulator prices without their weights (values from each
model's config.json), as dicts ``make_cost_model`` and ``ModelShape.from_hf_config`` read."""

# deepseek-ai/DeepSeek-V3 config.json (the MTP layer, num_nextn_predict_layers=1, is not in
# num_hidden_layers).
DEEPSEEK_V3 = {
    "hidden_size": 7168, "vocab_size": 129280, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "num_nextn_predict_layers": 1,
}

# widellm's preset:deepseek-v3-small (widellm/model/presets.py).
DEEPSEEK_V3_SMALL = {
    "hidden_size": 1024, "vocab_size": 32000, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 3072,
    "moe_intermediate_size": 384, "n_routed_experts": 64, "num_experts_per_tok": 6,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 512,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
}

# meta-llama/Meta-Llama-3-8B config.json
LLAMA3_8B = {
    "hidden_size": 4096, "vocab_size": 128256, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
}

# Qwen/Qwen3-30B-A3B config.json
QWEN3_30B_A3B = {
    "hidden_size": 2048, "vocab_size": 151936, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
}
