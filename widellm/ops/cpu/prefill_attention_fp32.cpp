// fp32 path of the causal prefill kernel (the contract: prefill_attention.cpp; the path's
// members: prefill_attention.h), in AVX2 + FMA, for the CPUs where widellm serves in fp32
// because they have no native bf16 matmuls (AMD Zen 1-3, Intel client cores):
//   1. pack, per KV head: keys in panels of 8 positions ([L / 8][Dk][8]: component d of 8 keys
//      is one vector), zero past L; value rows copied together ([L][Dv]);
//   2. attend, per block of 16 queries of one query head: scores of 6 query rows x 16 keys a
//      pass (a query component broadcast against two key vectors, 12 accumulators of the 16
//      registers), each group of rows up to its last row's causal prefix; softmax per query
//      row over its prefix, exps in fp32, the division by their sum applied to the output
//      rows (as flash attention does); out = 6 probability rows x 16 value columns a pass.
//
// Why: the layers' other path, torch's flash attention for CPUs, took ~11% of a 2,048-token
// fp32 prefill step of SmolLM2 on a 2-core AMD Zen 3 (~2.1 ms per 256-token prompt per layer,
// one call per prompt), about a fifth of the FMA peak.
#include "prefill_attention.h"

#include "vec.h"

#include <algorithm>
#include <cstring>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
namespace widellm_cpu::prefill {
namespace {

constexpr int64_t kLanes = 8;     // floats of a 256-bit vector, and keys of a packed panel
constexpr int kGroupRows = 6;     // query rows accumulated together
constexpr int kGroupVectors = 2;  // 8-wide key or value-column vectors per pass

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// scores[r][k0 + j] (row stride lds) <- q row r . key k0 + j for r < kR, j < 8 * kC: kR query
// rows (row stride q_stride) against kC packed panels of 8 keys from k0 (a multiple of 8).
template <int kR, int kC>
void score_vectors(const float* q, int64_t q_stride, const float* k_packed, int64_t k0,
                   int64_t Dk, float* scores, int64_t lds) {
  __m256 acc[kR][kC];
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* panel = k_packed + k0 * Dk;  // a panel of 8 keys is [Dk][8]
  for (int64_t d = 0; d < Dk; ++d) {
    __m256 keys[kC];
    for (int c = 0; c < kC; ++c) keys[c] = _mm256_loadu_ps(panel + (c * Dk + d) * kLanes);
    for (int r = 0; r < kR; ++r) {
      const __m256 x = _mm256_broadcast_ss(q + r * q_stride + d);
      for (int c = 0; c < kC; ++c) acc[r][c] = _mm256_fmadd_ps(x, keys[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c) _mm256_storeu_ps(scores + r * lds + k0 + c * kLanes, acc[r][c]);
}

// score_vectors over keys [0, keys rounded up to 8) for kR query rows.
template <int kR>
void score_rows(const float* q, int64_t q_stride, const float* k_packed, int64_t keys,
                int64_t Dk, float* scores, int64_t lds) {
  const int64_t K8 = round_up(keys, kLanes);
  int64_t k0 = 0;
  for (; k0 + kGroupVectors * kLanes <= K8; k0 += kGroupVectors * kLanes)
    score_vectors<kR, kGroupVectors>(q, q_stride, k_packed, k0, Dk, scores, lds);
  if (k0 < K8) score_vectors<kR, 1>(q, q_stride, k_packed, k0, Dk, scores, lds);
}

// out rows [0, kR) (row stride out_row), columns [c0, c0 + 8 * kC) <- row_scale[r] *
// (probs rows (row stride ldp) x value rows) over positions [0, keys).
template <int kR, int kC>
void value_vectors(const float* probs, int64_t ldp, int64_t keys, const float* values,
                   int64_t Dv, int64_t c0, const float* row_scale, float* out, int64_t out_row) {
  __m256 acc[kR][kC];
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t l = 0; l < keys; ++l) {
    __m256 v[kC];
    for (int c = 0; c < kC; ++c) v[c] = _mm256_loadu_ps(values + l * Dv + c0 + c * kLanes);
    for (int r = 0; r < kR; ++r) {
      const __m256 p = _mm256_broadcast_ss(probs + r * ldp + l);
      for (int c = 0; c < kC; ++c) acc[r][c] = _mm256_fmadd_ps(p, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c)
      _mm256_storeu_ps(out + r * out_row + c0 + c * kLanes,
                       _mm256_mul_ps(acc[r][c], _mm256_set1_ps(row_scale[r])));
}

// value_vectors over every column (Dv a multiple of 8) for kR rows whose causal prefixes end
// before `keys`.
template <int kR>
void value_rows(const float* probs, int64_t ldp, int64_t keys, const float* values, int64_t Dv,
                const float* row_scale, float* out, int64_t out_row) {
  int64_t c0 = 0;
  for (; c0 + kGroupVectors * kLanes <= Dv; c0 += kGroupVectors * kLanes)
    value_vectors<kR, kGroupVectors>(probs, ldp, keys, values, Dv, c0, row_scale, out, out_row);
  if (c0 < Dv) value_vectors<kR, 1>(probs, ldp, keys, values, Dv, c0, row_scale, out, out_row);
}

// p[:len] <- exp(scale * (s[j] - max_j s[j])), p[len:K8] <- 0 (K8 >= len, a multiple of 8);
// returns the sum of the exps. Scores past len may be stale (even NaN): they are masked off.
inline float exp_row(const float* s, int64_t len, float scale, float* p, int64_t K8) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  __m256 vmax = _mm256_set1_ps(m);
  for (; j + kLanes <= len; j += kLanes) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
  m = reduce_max8(vmax);
  for (; j < len; ++j) m = std::max(m, s[j]);
  const __m256 vscale = _mm256_set1_ps(scale), shift = _mm256_set1_ps(m * scale);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 vsum = _mm256_setzero_ps();
  for (j = 0; j < K8; j += kLanes) {
    const int left = static_cast<int>(std::clamp<int64_t>(len - j, 0, kLanes));
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane));
    const __m256 x = _mm256_loadu_ps(s + j);
    const __m256 e = _mm256_and_ps(valid, exp8(_mm256_fmsub_ps(x, vscale, shift)));
    vsum = _mm256_add_ps(vsum, e);
    _mm256_storeu_ps(p + j, e);
  }
  return reduce_add8(vsum);
}

}  // namespace

template <>
int64_t PrefillPath<float>::key_elems(int64_t L, int64_t Dk) { return round_up(L, kLanes) * Dk; }

template <>
int64_t PrefillPath<float>::value_elems(int64_t L, int64_t Dv) { return L * Dv; }

template <>
void PrefillPath<float>::pack(RowView<float> k, RowView<float> v, int64_t l0, int64_t l1,
                              int64_t L, int64_t Dk, int64_t Dv, float* k_packed,
                              float* values) {
  for (int64_t l = l0; l < l1; ++l) {
    float* panel = k_packed + l / kLanes * kLanes * Dk;
    const float* src = k.data + l * k.row;
    for (int64_t d = 0; d < Dk; ++d) panel[d * kLanes + l % kLanes] = src[d];
    std::memcpy(values + l * Dv, v.data + l * v.row, Dv * sizeof(float));
  }
  if (l1 == L)
    for (int64_t l = L; l < round_up(L, kLanes); ++l) {
      float* panel = k_packed + l / kLanes * kLanes * Dk;
      for (int64_t d = 0; d < Dk; ++d) panel[d * kLanes + l % kLanes] = 0.f;
    }
}

template <>
struct PrefillPath<float>::Worker {
  // Uninitialised growth, as in the bf16 path: every element is written before it is read.
  ScratchVector<float> scores;  // [16][lds]: keys rounded up to 8, then a cache line
  ScratchVector<float> probs;   // [16][ldp], likewise
  float inv_sum[kBlock];        // 1 / the sum of each query row's exps
};

template <>
PrefillPath<float>::PrefillPath(bool) : worker_(std::make_unique<Worker>()) {}

template <>
PrefillPath<float>::~PrefillPath() = default;

template <>
void PrefillPath<float>::attend(RowView<float> q, int64_t i0, int64_t n, int64_t p0,
                                const float* k_packed, const float* values, int64_t Dk,
                                int64_t Dv, float scale, float* out, int64_t out_row) {
  Worker& s = *worker_;
  const int64_t keys = p0 + n;  // the last query sees positions [0, p0 + n)
  const int64_t K8 = round_up(keys, kLanes);
  // Rows a cache line longer than they need: rows a multiple of 4 KiB apart share L1 sets.
  const int64_t ld = K8 + kCacheLine / static_cast<int64_t>(sizeof(float));
  s.scores.resize(kBlock * ld);
  s.probs.resize(kBlock * ld);
  const float* qa = q.data + i0 * q.row;
  for_row_groups<kGroupRows>(n, [&](auto rows, int64_t r) {
    constexpr int kR = decltype(rows)::value;
    score_rows<kR>(qa + r * q.row, q.row, k_packed, p0 + r + kR, Dk, s.scores.data() + r * ld,
                   ld);
  });
  for (int64_t r = 0; r < n; ++r)
    s.inv_sum[r] = 1.f / exp_row(s.scores.data() + r * ld, p0 + r + 1, scale,
                                 s.probs.data() + r * ld, K8);
  float* o = out + i0 * out_row;
  for_row_groups<kGroupRows>(n, [&](auto rows, int64_t r) {
    constexpr int kR = decltype(rows)::value;
    value_rows<kR>(s.probs.data() + r * ld, ld, p0 + r + kR, values, Dv, s.inv_sum + r,
                   o + r * out_row, out_row);
  });
}

}  // namespace widellm_cpu::prefill
#endif  // __AVX2__ && __FMA__
