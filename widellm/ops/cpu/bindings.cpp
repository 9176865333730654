// The Python module of widellm's CPU kernels (built by widellm/ops/cpu_kernels.py).
#include <torch/extension.h>

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

bool prefill_attention_supported(int64_t head_size, int64_t v_head_size);
void prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
                       double scale);

torch::Tensor moe_combine(torch::Tensor y, torch::Tensor weights);

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
std::vector<torch::Tensor> deepseek_decode_layers(
    torch::Tensor hidden, torch::Tensor positions, torch::Tensor slot_mapping,
    torch::Tensor block_table, torch::Tensor seq_lens,
    std::vector<std::vector<c10::optional<torch::Tensor>>> layers,
    std::vector<torch::Tensor> caches, torch::Tensor cos, torch::Tensor sin, bool interleaved,
    int64_t num_heads, int64_t qk_nope_head_dim, int64_t qk_rope_head_dim, int64_t v_head_dim,
    int64_t kv_lora_rank, double scale, double eps, int64_t top_k, bool sigmoid,
    bool renormalize, int64_t num_expert_group, int64_t topk_group, bool group_top2,
    double routed_scaling_factor, double renorm_eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention reading K/V in place (CPU); bf16_dot=False keeps bf16 on the "
        "vector path (tests and benchmarks compare the two)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("bf16_dot") = true);
  m.def("paged_decode_attention_backend", &paged_decode_attention_backend,
        "Path of paged_decode_attention in bf16 for (block_size, group, head_size, v_head_size): "
        "amx or vector");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :I]) * x[:, I:] (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm with Hugging Face's rounding (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "(rms_norm(x + residual), x + residual) in one pass (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "Rotary embedding of one [T, H, R] tensor (CPU)");
  m.def("mla_decode_supported", &mla_decode_supported,
        "Whether mla_decode_attention runs for (block_size, head_size, v_head_size) here");
  m.def("mla_decode_attention", &mla_decode_attention,
        "MLA decode attention over the paged latent cache, bf16 (CPU, AMX)");
  m.def("prefill_attention_supported", &prefill_attention_supported,
        "Whether prefill_attention runs for (head_size, v_head_size) here");
  m.def("prefill_attention", &prefill_attention,
        "Causal attention of one prompt chunk into out, bf16 (CPU, AMX)");
  m.def("moe_combine", &moe_combine,
        "sum_j weights[t, j] * y[t * k + j] in fp32, rounded once (CPU)");
  m.def("fused_experts_backend", &fused_experts_backend,
        "Path of fused_experts for (hidden_size, intermediate_size): amx, avx512_bf16 or none");
  m.def("fused_experts", &fused_experts,
        "Routed-expert MLPs of decode-sized batches, bf16 (CPU, AVX512-BF16)");
  m.def("llama_decode_layers", &llama_decode_layers,
        "Llama-family decoder layers over a decode-only batch in one call (CPU, packed "
        "linears); returns (output, residual)");
  m.def("deepseek_decode_layers", &deepseek_decode_layers,
        "DeepSeek-V2/V3 decoder layers (MLA, dense or local-expert MoE) over a decode-only "
        "batch in one call (CPU, bf16); returns (output, residual)");
}
