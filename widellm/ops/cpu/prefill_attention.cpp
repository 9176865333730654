// Causal attention of prompt chunks, bf16 (AMX tiles or AVX512-BF16 dot products) or fp32
// (AVX2 + FMA):
//   prefill_attention_batch(q [T, H, Dk], out [T, H, Dv], k[i] [L_i, Hkv, Dk],
//                           v[i] [L_i, Hkv, Dv], query_start_loc [n + 1], scale)
//   out[q0 + i, n] = softmax_j(scale * q[q0 + i, n] . k[j, n / G]) v[j, n / G],
//                    j <= L - Lq + i
// for each chunk: rows [q0, q0 + Lq) = [query_start_loc[c], query_start_loc[c + 1]) of q and
// out, context k[c], v[c] of L positions. Query i is the chunk's i-th token, at position
// L - Lq + i of its context (L - Lq cached positions come first); G = H / Hkv query heads
// share a KV head. Tokens and heads of every tensor may be strided (q, k, v are views of fused
// projections); each head's values are contiguous. prefill_attention(q, k, v, out, scale) is
// the one-chunk form.
//
//   1. per (chunk, KV head), once: keys and values packed for the path's products;
//   2. per (query head, block of 16 queries): scores up to the block's last position, softmax
//      of each query over its causal prefix in fp32, out = probabilities x values.
// The paths (prefill_attention.h) do the packing and the blocks; this file spreads them over
// the threads. Blocks are paired first with last in a task, so that a task's causal work is
// about the same for every pair of a chunk; the threads take tasks in turn, longest chunks
// first. One call for all of a step's chunks: a call per chunk cost ~10-15 us of set-up and
// thread wake-up each, and split 128-token prompts so finely that two threads were barely
// faster than one.
#include "prefill_attention.h"

#include "amx.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

namespace {

using namespace widellm_cpu::prefill;

// One prompt chunk of a batch: query rows [q0, q0 + Lq) of q and out, L context positions.
template <typename T>
struct Chunk {
  int64_t q0, Lq, L;
  RowView<T> k, v;                // KV head 0; heads are k_head / v_head elements apart
  int64_t k_head, v_head;
  int64_t k_packed, v_packed;     // offsets of this chunk's packed keys and values
  int64_t k_elems, v_elems;       // packed elements per KV head
  int64_t blocks, pairs;          // query blocks, and tasks pairing first with last
};

// The batch on the path of element type T (amx: see PrefillPath).
template <typename T>
void run_batch(const torch::Tensor& q, torch::Tensor& out, const std::vector<torch::Tensor>& k,
               const std::vector<torch::Tensor>& v, const std::vector<int64_t>& query_start_loc,
               double scale, bool amx) {
  using Path = PrefillPath<T>;
  const int64_t n = static_cast<int64_t>(k.size());
  if (n == 0) return;
  const int64_t H = q.size(1), Dk = q.size(2), Dv = out.size(2), Hkv = k[0].size(1);
  const int64_t G = H / Hkv;
  std::vector<Chunk<T>> chunks(n);
  int64_t k_total = 0, v_total = 0;
  for (int64_t i = 0; i < n; ++i) {
    Chunk<T>& c = chunks[i];
    c.q0 = query_start_loc[i];
    c.Lq = query_start_loc[i + 1] - c.q0;
    c.L = k[i].size(0);
    c.k = {k[i].data_ptr<T>(), k[i].stride(0)};
    c.v = {v[i].data_ptr<T>(), v[i].stride(0)};
    c.k_head = k[i].stride(1);
    c.v_head = v[i].stride(1);
    c.k_elems = Path::key_elems(c.L, Dk);
    c.v_elems = Path::value_elems(c.L, Dv);
    c.k_packed = k_total;
    c.v_packed = v_total;
    k_total += Hkv * c.k_elems;
    v_total += Hkv * c.v_elems;
    c.blocks = (c.Lq + kBlock - 1) / kBlock;
    c.pairs = (c.blocks + 1) / 2;
  }
  auto k_packed = torch::empty({k_total}, q.options());
  auto v_packed = torch::empty({v_total}, q.options());
  T* kp = k_packed.data_ptr<T>();
  T* vp = v_packed.data_ptr<T>();

  // 1. Pack every chunk's keys and values: tasks (chunk, KV head, kPackChunk positions).
  struct PackTask {
    int64_t chunk, head, l0;
  };
  std::vector<PackTask> packs;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t l0 = 0; l0 < chunks[i].L; l0 += kPackChunk) packs.push_back({i, h, l0});
  at::parallel_for(0, static_cast<int64_t>(packs.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const PackTask& p = packs[t];
      const Chunk<T>& c = chunks[p.chunk];
      Path::pack({c.k.data + p.head * c.k_head, c.k.row}, {c.v.data + p.head * c.v_head, c.v.row},
                 p.l0, std::min(c.L, p.l0 + kPackChunk), c.L, Dk, Dv,
                 kp + c.k_packed + p.head * c.k_elems, vp + c.v_packed + p.head * c.v_elems);
    }
  });

  // 2. Tasks (chunk, pair of query blocks, KV head), longest contexts first, taken by the threads
  // in turn: chunks of different lengths would leave a static split unbalanced.
  // A task covers the G query heads of one KV head: they read the same packed keys and values,
  // and their query rows are adjacent in each token's row (one stream of cache lines instead
  // of G tasks on either thread touching every G-th head's rows).
  struct AttendTask {
    int64_t chunk, pair, kv_head;
  };
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return chunks[a].L > chunks[b].L; });
  std::vector<AttendTask> tasks;
  for (int64_t i : order)
    for (int64_t pair = 0; pair < chunks[i].pairs; ++pair)
      for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({i, pair, h});
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const float fscale = static_cast<float>(scale);
  const T* qd = q.data_ptr<T>();
  T* od = out.data_ptr<T>();
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Path worker(amx);  // on this thread: AMX tiles are configured per thread
    for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) {
      const auto [i, pair, h] = tasks[t];
      const Chunk<T>& c = chunks[i];
      auto attend = [&](int64_t b, int64_t head) {
        const int64_t i0 = b * kBlock;
        worker.attend({qd + c.q0 * q.stride(0) + head * q.stride(1), q.stride(0)}, i0,
                      std::min(kBlock, c.Lq - i0), c.L - c.Lq + i0,
                      kp + c.k_packed + h * c.k_elems, vp + c.v_packed + h * c.v_elems, Dk, Dv,
                      fscale, od + c.q0 * out.stride(0) + head * out.stride(1), out.stride(0));
      };
      for (int64_t head = h * G; head < (h + 1) * G; ++head) {
        attend(pair, head);
        if (c.blocks - 1 - pair != pair) attend(c.blocks - 1 - pair, head);
      }
    }
  });
}

}  // namespace

std::string prefill_attention_backend(int64_t head_size, int64_t v_head_size,
                                      at::ScalarType dtype) {
  if (dtype == at::kBFloat16 && head_size % 32 == 0 && v_head_size % 32 == 0) {
#if WIDELLM_HAS_AMX
    if (widellm_cpu::amx_ready()) return "amx";
#endif
#if defined(__AVX512BF16__)
    return "avx512_bf16";
#endif
  }
#if defined(__AVX2__) && defined(__FMA__)
  if (dtype == at::kFloat && head_size % 8 == 0 && v_head_size % 8 == 0) return "avx2";
#endif
  return "none";
}

bool prefill_attention_supported(int64_t head_size, int64_t v_head_size, at::ScalarType dtype) {
  return prefill_attention_backend(head_size, v_head_size, dtype) != "none";
}

void prefill_attention_batch(torch::Tensor q, torch::Tensor out, std::vector<torch::Tensor> k,
                             std::vector<torch::Tensor> v, std::vector<int64_t> query_start_loc,
                             double scale, bool allow_amx) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3,
              "prefill_attention: q and out must be 3-D [tokens, heads, head_size]");
  const int64_t n = static_cast<int64_t>(k.size());
  TORCH_CHECK(static_cast<int64_t>(v.size()) == n &&
                  static_cast<int64_t>(query_start_loc.size()) == n + 1,
              "prefill_attention: one k and v per chunk and n + 1 query_start_loc");
  const int64_t H = q.size(1), Dk = q.size(2), Dv = out.size(2);
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == H,
              "prefill_attention: out must be [tokens, heads, v_head_size] like q");
  auto check_layout = [&](const torch::Tensor& t) {
    TORCH_CHECK(t.scalar_type() == dtype && t.device().is_cpu() && t.stride(2) == 1,
                "prefill_attention: CPU tensors of q's dtype, each head's values contiguous");
  };
  int64_t Hkv = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (const auto* t : {&k[i], &v[i]}) {
      TORCH_CHECK(t->dim() == 3, "prefill_attention: k and v must be 3-D [tokens, heads, size]");
      check_layout(*t);
    }
    if (i == 0) Hkv = k[i].size(1);
    const int64_t Lq = query_start_loc[i + 1] - query_start_loc[i], L = k[i].size(0);
    TORCH_CHECK(k[i].size(1) == Hkv && k[i].size(2) == Dk && v[i].size(0) == L &&
                    v[i].size(1) == Hkv && v[i].size(2) == Dv && L >= Lq && Lq >= 0 &&
                    query_start_loc[i] >= 0 && query_start_loc[i + 1] <= q.size(0),
                "prefill_attention: shapes do not match (chunk ", i, ")");
  }
  check_layout(q);
  check_layout(out);
  TORCH_CHECK(n == 0 || (Hkv >= 1 && H % Hkv == 0),
              "prefill_attention: query heads must be a multiple of KV heads");
  const std::string backend = prefill_attention_backend(Dk, Dv, dtype);
  TORCH_CHECK(backend != "none",
              "prefill_attention: needs bf16 with AMX or AVX512-BF16 and head sizes that are "
              "multiples of 32, or fp32 with AVX2 + FMA and multiples of 8");
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) {
    run_batch<at::BFloat16>(q, out, k, v, query_start_loc, scale, allow_amx && backend == "amx");
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  run_batch<float>(q, out, k, v, query_start_loc, scale, false);
#endif
}

void prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
                       double scale, bool allow_amx) {
  TORCH_CHECK(q.dim() == 3, "prefill_attention: q must be 3-D [tokens, heads, head_size]");
  prefill_attention_batch(q, out, {k}, {v}, {0, q.size(0)}, scale, allow_amx);  // checks the rest
}
