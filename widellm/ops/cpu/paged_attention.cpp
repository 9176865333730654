// Paged decode attention for CPUs: one query token per sequence, keys and values read in
// place from the paged cache (no gathered copy of the context).
//
//   out[b, h, g, :Dv] = softmax_l(scale * q[b, h, g, :Dk] . K[slot(b, l), h, :Dk]) V[slot(b, l), h, :Dv]
//   slot(b, l) = block_table[b, l / block_size] * block_size + l % block_size,  l < seq_lens[b]
//
// h is the KV head and g indexes the query heads that share it (grouped-query attention; MLA
// decode is Hkv = 1 with every query head in g and V a prefix of the latent K row). Each
// K row is scored by its G query rows while it is in cache, so every K and V row is read
// once per step. Accumulation is in fp32, in 16-lane (AVX-512) or 8-lane (AVX2) FMA chains
// where head sizes allow. bf16 caches in 16-row blocks with head sizes that are multiples of
// 32 take the AVX512-BF16 path instead (paged_attention_bf16.cpp), where the CPU has it.
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace widellm_cpu;

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out[g * ld + j] = q[g] . k[j] for g < G, j < n.  q [G, D], k [n, D] fp32 with rows ks apart.
inline void score_rows(const float* q, const float* k, int64_t ks, int64_t G, int64_t n,
                       int64_t D, float* out, int64_t ld) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    // Sixteen K rows per pass: sixteen independent FMA chains, reduced together.
    for (; j + 16 <= n; j += 16) {
      const float* k0 = k + j * ks;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 vq = _mm512_loadu_ps(qg + d);
          for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(vq, _mm512_loadu_ps(k0 + r * ks + d), acc[r]);
        }
        _mm512_storeu_ps(out + g * ld + j, reduce16(acc));
      }
    }
    // Four K rows per pass: four independent FMA chains share each load of q.
    for (; j + 4 <= n; j += 4) {
      const float* k0 = k + j * ks;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 vq = _mm512_loadu_ps(qg + d);
          a0 = _mm512_fmadd_ps(vq, _mm512_loadu_ps(k0 + d), a0);
          a1 = _mm512_fmadd_ps(vq, _mm512_loadu_ps(k0 + ks + d), a1);
          a2 = _mm512_fmadd_ps(vq, _mm512_loadu_ps(k0 + 2 * ks + d), a2);
          a3 = _mm512_fmadd_ps(vq, _mm512_loadu_ps(k0 + 3 * ks + d), a3);
        }
        float* o = out + g * ld + j;
        o[0] = _mm512_reduce_add_ps(a0);
        o[1] = _mm512_reduce_add_ps(a1);
        o[2] = _mm512_reduce_add_ps(a2);
        o[3] = _mm512_reduce_add_ps(a3);
      }
    }
  }
#elif defined(WIDELLM_AVX2)
  if (D % 8 == 0) {
    // Eight K rows per pass (eight FMA chains, reduced four at a time), then four.
    for (; j + 8 <= n; j += 8) {
      const float* k0 = k + j * ks;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        __m256 acc[8];
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 vq = _mm256_loadu_ps(qg + d);
          for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(vq, _mm256_loadu_ps(k0 + r * ks + d), acc[r]);
        }
        float* o = out + g * ld + j;
        _mm_storeu_ps(o, reduce4(acc[0], acc[1], acc[2], acc[3]));
        _mm_storeu_ps(o + 4, reduce4(acc[4], acc[5], acc[6], acc[7]));
      }
    }
    for (; j + 4 <= n; j += 4) {
      const float* k0 = k + j * ks;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 vq = _mm256_loadu_ps(qg + d);
          a0 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(k0 + d), a0);
          a1 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(k0 + ks + d), a1);
          a2 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(k0 + 2 * ks + d), a2);
          a3 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(k0 + 3 * ks + d), a3);
        }
        _mm_storeu_ps(out + g * ld + j, reduce4(a0, a1, a2, a3));
      }
    }
  }
#endif
  for (; j < n; ++j) {
    for (int64_t g = 0; g < G; ++g) out[g * ld + j] = dot(q + g * D, k + j * ks, D);
  }
}

// acc[g] += sum_j p[g * ld + j] * v[j] for g < G.  v [n, D] with rows vs apart, acc [G, D] fp32.
inline void accumulate_rows(const float* p, int64_t ld, const float* v, int64_t vs, int64_t G,
                            int64_t n, int64_t D, float* acc) {
  for (int64_t g = 0; g < G; ++g) {
    const float* pg = p + g * ld;
    float* ag = acc + g * D;
    int64_t d = 0;
#if defined(__AVX512F__)
    // Accumulators stay in registers across the n rows: 64 columns (four chains) at a time.
    for (; d + 64 <= D; d += 64) {
      __m512 a0 = _mm512_loadu_ps(ag + d), a1 = _mm512_loadu_ps(ag + d + 16);
      __m512 a2 = _mm512_loadu_ps(ag + d + 32), a3 = _mm512_loadu_ps(ag + d + 48);
      for (int64_t j = 0; j < n; ++j) {
        const __m512 vp = _mm512_set1_ps(pg[j]);
        const float* vj = v + j * vs + d;
        a0 = _mm512_fmadd_ps(vp, _mm512_loadu_ps(vj), a0);
        a1 = _mm512_fmadd_ps(vp, _mm512_loadu_ps(vj + 16), a1);
        a2 = _mm512_fmadd_ps(vp, _mm512_loadu_ps(vj + 32), a2);
        a3 = _mm512_fmadd_ps(vp, _mm512_loadu_ps(vj + 48), a3);
      }
      _mm512_storeu_ps(ag + d, a0);
      _mm512_storeu_ps(ag + d + 16, a1);
      _mm512_storeu_ps(ag + d + 32, a2);
      _mm512_storeu_ps(ag + d + 48, a3);
    }
    for (; d + 16 <= D; d += 16) {
      __m512 a = _mm512_loadu_ps(ag + d);
      for (int64_t j = 0; j < n; ++j) {
        a = _mm512_fmadd_ps(_mm512_set1_ps(pg[j]), _mm512_loadu_ps(v + j * vs + d), a);
      }
      _mm512_storeu_ps(ag + d, a);
    }
#elif defined(WIDELLM_AVX2)
    // 32 columns (four chains) at a time, then 8.
    for (; d + 32 <= D; d += 32) {
      __m256 a0 = _mm256_loadu_ps(ag + d), a1 = _mm256_loadu_ps(ag + d + 8);
      __m256 a2 = _mm256_loadu_ps(ag + d + 16), a3 = _mm256_loadu_ps(ag + d + 24);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 vp = _mm256_set1_ps(pg[j]);
        const float* vj = v + j * vs + d;
        a0 = _mm256_fmadd_ps(vp, _mm256_loadu_ps(vj), a0);
        a1 = _mm256_fmadd_ps(vp, _mm256_loadu_ps(vj + 8), a1);
        a2 = _mm256_fmadd_ps(vp, _mm256_loadu_ps(vj + 16), a2);
        a3 = _mm256_fmadd_ps(vp, _mm256_loadu_ps(vj + 24), a3);
      }
      _mm256_storeu_ps(ag + d, a0);
      _mm256_storeu_ps(ag + d + 8, a1);
      _mm256_storeu_ps(ag + d + 16, a2);
      _mm256_storeu_ps(ag + d + 24, a3);
    }
    for (; d + 8 <= D; d += 8) {
      __m256 a = _mm256_loadu_ps(ag + d);
      for (int64_t j = 0; j < n; ++j) {
        a = _mm256_fmadd_ps(_mm256_set1_ps(pg[j]), _mm256_loadu_ps(v + j * vs + d), a);
      }
      _mm256_storeu_ps(ag + d, a);
    }
#endif
    for (; d < D; ++d) {
      float a = ag[d];
      for (int64_t j = 0; j < n; ++j) a += pg[j] * v[j * vs + d];
      ag[d] = a;
    }
  }
}

// The block holding positions [l0, l0 + block_size) of a sequence (cache strides s_blk,
// s_pos in elements); starts fetching the sequence's next block, if any, meanwhile.
template <typename T>
inline const T* block_base(const T* cache, int64_t s_blk, int64_t s_pos, const int64_t* blocks,
                           int64_t l0, int64_t block_size, int64_t L) {
  if (l0 + block_size < L) {
    prefetch_bytes(cache + blocks[l0 / block_size + 1] * s_blk, block_size * s_pos * sizeof(T));
  }
  return cache + blocks[l0 / block_size] * s_blk;
}

// buf [n, D] fp32 <- rows [0, n) of KV head h of a block.
template <typename T>
inline void widen_rows(const T* block, int64_t s_pos, int64_t s_h, int64_t h, int64_t n,
                       int64_t D, float* buf) {
  for (int64_t j = 0; j < n; ++j) row_to_float(block + j * s_pos + h * s_h, buf + j * D, D);
}

// Rows [0, n) of KV head h of a block as fp32 rows and their stride: the cache itself for an
// fp32 cache, else buf [n, D] after widen_rows.
template <typename T>
inline std::pair<const float*, int64_t> fp32_rows(const T* block, int64_t s_pos, int64_t s_h,
                                                  int64_t h, int64_t n, int64_t D, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return {block + h * s_h, s_pos};
  } else {
    widen_rows(block, s_pos, s_h, h, n, D, buf);
    return {buf, D};
  }
}

template <typename T>
void decode_kernel(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                   const torch::Tensor& v_cache, const torch::Tensor& block_table,
                   const torch::Tensor& seq_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), Dk = q.size(3);
  const int64_t Dv = v_cache.size(3);
  const int64_t block_size = k_cache.size(1);
  const int64_t max_blocks = block_table.size(1);
  // Element strides of the caches: [num_blocks, block_size, Hkv, D].
  const int64_t ks_blk = k_cache.stride(0), ks_pos = k_cache.stride(1), ks_h = k_cache.stride(2);
  const int64_t vs_blk = v_cache.stride(0), vs_pos = v_cache.stride(1), vs_h = v_cache.stride(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* bt = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  // One task per sequence, walked one block at a time: the block's rows of a KV head are
  // widened to fp32 once, then scored by (and accumulated for) the G query heads sharing it.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    const int64_t HG = H * G;
    std::vector<float> qf(HG * Dk), kbuf(block_size * Dk), vbuf(block_size * Dv), acc(HG * Dv);
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b];
      const int64_t* blocks = bt + b * max_blocks;
      const T* qrow = qp + b * HG * Dk;
      for (int64_t i = 0; i < HG * Dk; ++i) qf[i] = to_float(qrow[i]) * fscale;
      scores.assign(HG * L, 0.f);  // [H * G, L]
      std::fill(acc.begin(), acc.end(), 0.f);

      for (int64_t l0 = 0; l0 < L; l0 += block_size) {
        const int64_t n = std::min(block_size, L - l0);
        const T* kblock = block_base(kp, ks_blk, ks_pos, blocks, l0, block_size, L);
        for (int64_t h = 0; h < H; ++h) {
          // fp32 rows are scored where they are in the cache; others widened first.
          const auto [krows, kstride] = fp32_rows(kblock, ks_pos, ks_h, h, n, Dk, kbuf.data());
          score_rows(qf.data() + h * G * Dk, krows, kstride, G, n, Dk,
                     scores.data() + h * G * L + l0, L);
        }
      }
      for (int64_t hg = 0; hg < HG && L > 0; ++hg) softmax_inplace(scores.data() + hg * L, L);
      for (int64_t l0 = 0; l0 < L; l0 += block_size) {
        const int64_t n = std::min(block_size, L - l0);
        const T* vblock = block_base(vp, vs_blk, vs_pos, blocks, l0, block_size, L);
        for (int64_t h = 0; h < H; ++h) {
          const auto [vrows, vstride] = fp32_rows(vblock, vs_pos, vs_h, h, n, Dv, vbuf.data());
          accumulate_rows(scores.data() + h * G * L + l0, L, vrows, vstride, G, n, Dv,
                          acc.data() + h * G * Dv);
        }
      }
      row_from_float(acc.data(), op + b * HG * Dv, HG * Dv);
    }
  });
}

}  // namespace

bool paged_decode_bf16_supported(int64_t block_size, int64_t group, int64_t head_size,
                                int64_t v_head_size);
void paged_decode_attention_bf16(torch::Tensor& out, const torch::Tensor& q,
                                const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                                double scale);

// Which path paged_decode_attention takes for bf16 (fp32 and fp16 always take "vector").
std::string paged_decode_attention_backend(int64_t block_size, int64_t group, int64_t head_size,
                                           int64_t v_head_size) {
  const bool fast = paged_decode_bf16_supported(block_size, group, head_size, v_head_size);
  return fast ? "avx512_bf16" : "vector";
}

// q [B, Hkv, G, Dk] contiguous; k_cache [num_blocks, block_size, Hkv, Dk] and v_cache
// [num_blocks, block_size, Hkv, Dv] with unit stride in the last dim (v may be a view into the
// same storage as k); block_table [B, max_blocks] int64; seq_lens [B] int64.
// Returns [B, Hkv, G, Dv] in q's dtype.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale, bool bf16_dot) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4, "expected 4-D q and caches");
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache rows must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and caches must share a dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(3), "q and k head sizes differ");
  TORCH_CHECK(k_cache.size(2) == q.size(1) && v_cache.size(2) == q.size(1), "KV head counts differ");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.is_contiguous(),
              "block_table must be contiguous int64");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int64");
  TORCH_CHECK(block_table.size(0) == q.size(0) && seq_lens.size(0) == q.size(0), "batch sizes differ");
  // Every block a sequence reaches must exist: the kernels read them without further checks.
  const int64_t* bt = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), max_blocks = block_table.size(1);
  const int64_t num_blocks = std::min(k_cache.size(0), v_cache.size(0));
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 0 && lens[b] <= max_blocks * block_size,
                      "paged_decode_attention: seq_lens[", b, "] out of range");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK_VALUE(bt[b * max_blocks + i] >= 0 && bt[b * max_blocks + i] < num_blocks,
                        "paged_decode_attention: block id out of range");
  }
  auto out = torch::empty({q.size(0), q.size(1), q.size(2), v_cache.size(3)}, q.options());
  if (bf16_dot && q.scalar_type() == torch::kBFloat16 &&
      paged_decode_bf16_supported(block_size, q.size(2), q.size(3), v_cache.size(3))) {
    paged_decode_attention_bf16(out, q, k_cache, v_cache, block_table, seq_lens, scale);
    return out;
  }
  dispatch_float_types(q.scalar_type(), "paged_decode_attention", [&](auto t) {
    decode_kernel<decltype(t)>(out, q, k_cache, v_cache, block_table, seq_lens, scale);
  });
  return out;
}
