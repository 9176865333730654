// DeepSeek-V2/V3 decoder layers (MLA attention, dense or MoE MLP) over a decode-only batch, in
// one call: the ops of DeepseekMLAAttention, MLAAttention's in-place decode, select_experts,
// the local dispatcher, fused_experts and the shared experts, in the order the Python modules
// run them, so the results are the same bit for bit (tests/ops/test_cpu_decoder_layers.py).
// widellm/model/fused_decode.py decides when it applies and gathers the weights.
#include "decode_layers.h"
#include "ops.h"

#include <limits>

using decode_layers::OptTensor;
using decode_layers::packed_linear;

namespace {

// Slots of one layer's weight list (widellm/model/fused_decode.py builds it in this order).
enum Slot : size_t {
  kInputNorm, kPostNorm,
  kQProj, kQProjBias,                       // without q_lora_rank
  kQA, kQABias, kQANorm, kQB, kQBBias,      // with q_lora_rank
  kKVA, kKVABias, kKVANorm,
  kWUK, kWUVT,                              // [H, nope, kv_lora], [H, kv_lora, v]
  kO, kOBias,
  kGateUp, kDown,                           // dense MLP, or the MoE layer's shared experts
  kRouter, kRouterBias,                     // fp32 [E, H], [E]; no router: a dense layer
  kW13, kW2,                                // routed experts [E, 2I, H], [E, H, I]
  kNumSlots
};

struct MlaShape {
  int64_t heads, nope, rope, v_head, kv_lora;
  double scale, eps;
  bool interleaved;
};

struct Routing {
  int64_t top_k, num_groups, topk_group;  // num_groups 0: no group-limited routing
  bool sigmoid, renormalize, group_top2;
  double scaling, renorm_eps;
};

const torch::Tensor& need(const std::vector<OptTensor>& w, Slot s) {
  TORCH_CHECK(w[s].has_value(), "deepseek_decode_layers: weight slot ", static_cast<int>(s),
              " missing");
  return *w[s];
}

// select_experts: (topk_weights [T, k] fp32, topk_ids [T, k] int64).
std::pair<torch::Tensor, torch::Tensor> select_experts(const torch::Tensor& logits,
                                                       const OptTensor& bias, const Routing& r) {
  const auto scores = r.sigmoid ? logits.sigmoid() : logits.softmax(-1);
  auto choice = bias.has_value() ? scores + bias->to(torch::kFloat) : scores;
  if (r.num_groups > 0 && r.topk_group < r.num_groups) {
    const int64_t T = choice.size(0), E = choice.size(1);
    const auto grouped = choice.view({T, r.num_groups, E / r.num_groups});
    const auto group_scores = r.group_top2
        ? std::get<0>(grouped.topk(2, -1)).sum(-1)
        : std::get<0>(grouped.max(-1));
    const auto group_idx = std::get<1>(torch::topk(group_scores, r.topk_group, -1, true, false));
    auto group_mask = torch::zeros_like(group_scores, torch::kBool);
    group_mask.scatter_(1, group_idx, true);
    const auto eligible = group_mask.unsqueeze(-1).expand_as(grouped).reshape({T, E});
    choice = choice.masked_fill(eligible.logical_not(),
                                -std::numeric_limits<float>::infinity());
  }
  const auto ids = std::get<1>(torch::topk(choice, r.top_k, -1, true, false));
  auto weights = scores.gather(1, ids);
  if (r.renormalize) weights = weights / (weights.sum(-1, true) + r.renorm_eps);
  if (r.scaling != 1.0) weights = weights * r.scaling;
  return {weights, ids};
}

torch::Tensor swiglu_mlp(const c10::OperatorHandle& op, const torch::Tensor& x,
                         const torch::Tensor& gate_up, const torch::Tensor& down) {
  return packed_linear(op, silu_and_mul(packed_linear(op, x, gate_up, c10::nullopt)), down,
                       c10::nullopt);
}

// DeepseekMoE.forward for a batch without padding, local experts: routed + shared.
torch::Tensor moe(const c10::OperatorHandle& op, const torch::Tensor& x,
                  const std::vector<OptTensor>& w, const Routing& r) {
  const auto logits = at::linear(x.to(torch::kFloat), need(w, kRouter));
  auto [weights, ids] = select_experts(logits, w[kRouterBias], r);
  const int64_t T = x.size(0), H = x.size(1);
  // The local dispatcher: token t's j-th expert is row t * k + j.
  const auto rows = x.unsqueeze(1).expand({T, r.top_k, H}).reshape({T * r.top_k, H});
  const auto y = fused_experts(rows.contiguous(), ids.reshape(-1).contiguous(), need(w, kW13),
                               need(w, kW2));
  auto out = moe_combine(y, weights.contiguous());
  if (w[kGateUp].has_value()) out = out + swiglu_mlp(op, x, *w[kGateUp], need(w, kDown));
  return out;
}

// DeepseekMLAAttention.forward at decode: x [T, hidden] -> [T, hidden].
torch::Tensor mla_attention(const c10::OperatorHandle& op, const torch::Tensor& x,
                            const std::vector<OptTensor>& w, torch::Tensor& cache,
                            const torch::Tensor& positions, const int64_t* slots,
                            const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                            const torch::Tensor& cos, const torch::Tensor& sin,
                            const MlaShape& s) {
  const int64_t T = x.size(0);
  const auto q_flat = w[kQProj].has_value()
      ? packed_linear(op, x, *w[kQProj], w[kQProjBias])
      : packed_linear(op, rms_norm(packed_linear(op, x, need(w, kQA), w[kQABias]),
                                   need(w, kQANorm), s.eps),
                      need(w, kQB), w[kQBBias]);
  const auto q = q_flat.view({T, s.heads, s.nope + s.rope});
  const auto kv = packed_linear(op, x, need(w, kKVA), w[kKVABias]);  // [T, kv_lora + rope]
  const auto kv_c = rms_norm(kv.narrow(1, 0, s.kv_lora), need(w, kKVANorm), s.eps);
  const auto q_pe = rotary_embedding(positions, q.narrow(2, s.nope, s.rope), cos, sin,
                                     s.interleaved);
  const auto k_pe = rotary_embedding(positions, kv.narrow(1, s.kv_lora, s.rope).unsqueeze(1),
                                     cos, sin, s.interleaved);
  auto rows = cache.flatten(0, 1);  // [slots, kv_lora + rope]
  decode_layers::store_rows(kv_c, rows, slots);
  decode_layers::store_rows(k_pe, rows, slots, s.kv_lora);
  // Absorbed query: q_nope through W_UK into latent space, next to the rotated q_pe.
  const auto q_cat = torch::cat(
      {torch::bmm(q.narrow(2, 0, s.nope).transpose(0, 1), need(w, kWUK)).transpose(0, 1), q_pe},
      -1);
  const auto o_lat = mla_decode_attention(q_cat.contiguous(), cache, block_table, seq_lens,
                                          s.kv_lora, s.scale);
  const auto o = torch::bmm(o_lat.transpose(0, 1), need(w, kWUVT)).transpose(0, 1).contiguous();
  return packed_linear(op, o.view({T, s.heads * s.v_head}), need(w, kO), w[kOBias]);
}

}  // namespace

// hidden [T, H] bf16 embeddings of a decode-only batch (token t: row t of block_table /
// seq_lens, cache slot slot_mapping[t], position positions[t]); layers[i] the weight slots
// above; caches[i] [num_blocks, block_size, kv_lora + rope]. Returns (output, residual) of the
// last layer, as DecoderLayer.forward does.
std::vector<torch::Tensor> deepseek_decode_layers(
    torch::Tensor hidden, torch::Tensor positions, torch::Tensor slot_mapping,
    torch::Tensor block_table, torch::Tensor seq_lens, std::vector<std::vector<OptTensor>> layers,
    std::vector<torch::Tensor> caches, torch::Tensor cos, torch::Tensor sin, bool interleaved,
    int64_t num_heads, int64_t qk_nope_head_dim, int64_t qk_rope_head_dim, int64_t v_head_dim,
    int64_t kv_lora_rank, double scale, double eps, int64_t top_k, bool sigmoid,
    bool renormalize, int64_t num_expert_group, int64_t topk_group, bool group_top2,
    double routed_scaling_factor, double renorm_eps) {
  const size_t L = layers.size();
  TORCH_CHECK(caches.size() == L, "deepseek_decode_layers: one cache per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous [T, H]");
  const int64_t T = hidden.size(0);
  TORCH_CHECK(positions.size(0) == T, "deepseek_decode_layers: positions must be [T]");
  for (size_t i = 0; i < L; ++i) {
    TORCH_CHECK(layers[i].size() == kNumSlots, "deepseek_decode_layers: layer ", i, " has ",
                layers[i].size(), " weight slots, expected ", static_cast<int>(kNumSlots));
    const auto& c = caches[i];
    TORCH_CHECK(c.dim() == 3 && c.is_contiguous() && c.size(2) == kv_lora_rank + qk_rope_head_dim &&
                    c.size(0) == caches[0].size(0) && c.size(1) == caches[0].size(1),
                "caches[", i, "] must be contiguous [num_blocks, block_size, kv_lora + rope]");
  }
  if (L > 0)
    decode_layers::check_slots(slot_mapping, T, caches[0].size(0) * caches[0].size(1),
                               "deepseek_decode_layers");
  const MlaShape shape{num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank,
                       scale, eps, interleaved};
  const Routing routing{top_k, num_expert_group, topk_group, sigmoid, renormalize, group_top2,
                        routed_scaling_factor, renorm_eps};
  const auto op = decode_layers::packed_linear_op();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();

  torch::Tensor x = hidden, res;
  for (size_t i = 0; i < L; ++i) {
    const auto& w = layers[i];
    torch::Tensor h;
    if (!res.defined()) {  // first layer: its input is the residual stream itself
      res = x;
      h = rms_norm(x, need(w, kInputNorm), eps);
    } else {
      auto r = fused_add_rms_norm(x, res, need(w, kInputNorm), eps);
      h = r[0];
      res = r[1];
    }
    const auto attn = mla_attention(op, h, w, caches[i], positions, slots, block_table,
                                    seq_lens, cos, sin, shape);
    auto r = fused_add_rms_norm(attn, res, need(w, kPostNorm), eps);
    res = r[1];
    x = w[kRouter].has_value() ? moe(op, r[0], w, routing)
                               : swiglu_mlp(op, r[0], need(w, kGateUp), need(w, kDown));
  }
  return {x, res};
}
