// The kernels' entry points, as the Python module exposes them (bindings.cpp) and as the
// one-call decode stack (decoder_layers.cpp) calls them.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale, bool bf16_dot);
std::string paged_decode_attention_backend(int64_t block_size, int64_t group, int64_t head_size,
                                           int64_t v_head_size);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> fused_add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                              torch::Tensor weight, double eps);
torch::Tensor rotary_embedding(torch::Tensor positions, torch::Tensor x, torch::Tensor cos,
                               torch::Tensor sin, bool interleaved);
std::string fused_experts_backend(int64_t hidden_size, int64_t inter);
torch::Tensor fused_experts(torch::Tensor hidden, torch::Tensor expert_ids, torch::Tensor w13,
                            torch::Tensor w2);

bool mla_decode_supported(int64_t block_size, int64_t head_size, int64_t v_head_size);
torch::Tensor mla_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_table,
                                   torch::Tensor seq_lens, int64_t v_head_size, double scale);

std::string prefill_attention_backend(int64_t head_size, int64_t v_head_size,
                                      at::ScalarType dtype);
bool prefill_attention_supported(int64_t head_size, int64_t v_head_size, at::ScalarType dtype);
void prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
                       double scale, bool allow_amx);
void prefill_attention_batch(torch::Tensor q, torch::Tensor out, std::vector<torch::Tensor> k,
                             std::vector<torch::Tensor> v, std::vector<int64_t> query_start_loc,
                             double scale, bool allow_amx);

torch::Tensor moe_combine(torch::Tensor y, torch::Tensor weights);
void store_kv_cache(torch::Tensor src, torch::Tensor rows, torch::Tensor slot_mapping);

std::vector<torch::Tensor> llama_decode_layers(
    torch::Tensor hidden, torch::Tensor positions,
    torch::Tensor slot_mapping, torch::Tensor block_table, torch::Tensor seq_lens,
    std::vector<torch::Tensor> input_norm, std::vector<torch::Tensor> post_norm,
    std::vector<torch::Tensor> qkv_w, std::vector<c10::optional<torch::Tensor>> qkv_b,
    std::vector<torch::Tensor> o_w, std::vector<c10::optional<torch::Tensor>> o_b,
    std::vector<torch::Tensor> gate_up_w, std::vector<torch::Tensor> down_w,
    std::vector<torch::Tensor> kv_caches, torch::Tensor cos, torch::Tensor sin,
    bool interleaved, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
    double eps);
