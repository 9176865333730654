// A stack of Llama-family decoder layers over a decode-only batch, in one call.
//
// A decode step of a small model spent a quarter of its time between its kernels: ~12 Python
// calls per layer (module dispatch, views, splits, cache stores), ~300 us per layer on this
// machine at 16 sequences. This file runs the same kernels in the same order from C++: the
// oneDNN packed linears (mkldnn::_linear_pointwise, what PackedLinear.forward calls), the fused
// norms, rotary, the paged decode attention kernel; so its results equal the Python layers'
// bit for bit (tests/ops/test_cpu_decoder_layers.py). widellm/model/fused_decode.py decides
// when it applies and gathers the weights.
#include "decode_layers.h"
#include "ops.h"

using decode_layers::OptTensor;
using decode_layers::packed_linear;
using decode_layers::store_rows;

// hidden [T, H] bf16 or fp32: the embeddings of a decode-only batch; every token is one
// sequence's decode token (row t of block_table [T, max_blocks] and seq_lens [T], its cache
// slot slot_mapping[t], its position positions[t]). Per layer i: input/post norm weights [H];
// packed qkv / o / gate_up / down weights with optional qkv and o biases; kv_caches[i]
// [2, num_blocks, block_size, Hkv, D]. cos/sin [max_pos, D] fp32 as RotaryEmbedding holds
// them. Returns (output, residual) of the last layer, as DecoderLayer.forward does.
std::vector<torch::Tensor> llama_decode_layers(
    torch::Tensor hidden, torch::Tensor positions,
    torch::Tensor slot_mapping, torch::Tensor block_table, torch::Tensor seq_lens,
    std::vector<torch::Tensor> input_norm, std::vector<torch::Tensor> post_norm,
    std::vector<torch::Tensor> qkv_w, std::vector<OptTensor> qkv_b,
    std::vector<torch::Tensor> o_w, std::vector<OptTensor> o_b,
    std::vector<torch::Tensor> gate_up_w, std::vector<torch::Tensor> down_w,
    std::vector<torch::Tensor> kv_caches, torch::Tensor cos, torch::Tensor sin,
    bool interleaved, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
    double eps) {
  const size_t L = input_norm.size();
  TORCH_CHECK(post_norm.size() == L && qkv_w.size() == L && qkv_b.size() == L &&
                  o_w.size() == L && o_b.size() == L && gate_up_w.size() == L &&
                  down_w.size() == L && kv_caches.size() == L,
              "llama_decode_layers: one entry per layer in every weight list");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous [T, H]");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t T = hidden.size(0);
  TORCH_CHECK(positions.size(0) == T, "llama_decode_layers: positions must be [T]");
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t G = num_heads / num_kv_heads;
  for (size_t i = 0; i < L; ++i) {
    const auto& c = kv_caches[i];
    TORCH_CHECK(c.dim() == 5 && c.size(0) == 2 && c.size(3) == num_kv_heads &&
                    c.size(4) == head_dim && c.is_contiguous() &&
                    c.size(1) == kv_caches[0].size(1) && c.size(2) == kv_caches[0].size(2),
                "kv_caches[", i, "] must be contiguous [2, num_blocks, block_size, Hkv, D]");
  }
  if (L > 0)
    decode_layers::check_slots(slot_mapping, T, kv_caches[0].size(1) * kv_caches[0].size(2),
                               "llama_decode_layers");
  const auto op = decode_layers::packed_linear_op();

  torch::Tensor x = hidden, res;
  for (size_t i = 0; i < L; ++i) {
    torch::Tensor h;
    if (!res.defined()) {  // first layer: its input is the residual stream itself
      res = x;
      h = rms_norm(x, input_norm[i], eps);
    } else {
      auto r = fused_add_rms_norm(x, res, input_norm[i], eps);
      h = r[0];
      res = r[1];
    }
    const torch::Tensor qkv = packed_linear(op, h, qkv_w[i], qkv_b[i]);  // [T, q + 2 kv]
    const auto q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    const auto k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    const auto q_rot = rotary_embedding(positions, q, cos, sin, interleaved);
    const auto k_rot = rotary_embedding(positions, k, cos, sin, interleaved);
    auto k_cache = kv_caches[i].select(0, 0);  // [num_blocks, block_size, Hkv, D]
    auto v_cache = kv_caches[i].select(0, 1);
    auto k_rows = k_cache.flatten(0, 1);
    auto v_rows = v_cache.flatten(0, 1);
    store_rows(k_rot, k_rows, slot_mapping.data_ptr<int64_t>());
    store_rows(v, v_rows, slot_mapping.data_ptr<int64_t>());
    const auto attn = paged_decode_attention(q_rot.view({T, num_kv_heads, G, head_dim}), k_cache,
                                             v_cache, block_table, seq_lens, scale, true);
    const auto o = packed_linear(op, attn.view({T, q_size}), o_w[i], o_b[i]);
    auto r = fused_add_rms_norm(o, res, post_norm[i], eps);
    res = r[1];
    const auto gate_up = packed_linear(op, r[0], gate_up_w[i], c10::nullopt);
    x = packed_linear(op, silu_and_mul(gate_up), down_w[i], c10::nullopt);
  }
  return {x, res};
}
