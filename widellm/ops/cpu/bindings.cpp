// The Python module of widellm's CPU kernels (built by widellm/ops/cpu_kernels.py).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> fused_add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                              torch::Tensor weight, double eps);
torch::Tensor rotary_embedding(torch::Tensor positions, torch::Tensor x, torch::Tensor cos,
                               torch::Tensor sin, bool interleaved);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention reading K/V in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :I]) * x[:, I:] (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm with Hugging Face's rounding (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "(rms_norm(x + residual), x + residual) in one pass (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "Rotary embedding of one [T, H, R] tensor (CPU)");
}
