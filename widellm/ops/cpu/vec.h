// Shared helpers of the CPU kernels: element conversions to fp32 and back, a vectorized exp
// and the SwiGLU gate. AVX-512 paths where the compiler targets it (-march=native), AVX2 + FMA
// paths for the fp32 attention math on CPUs without AVX-512 (AMD Zen 1-3, Intel client
// cores), plain loops otherwise.
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// AVX2 + FMA code paths run where AVX-512 is absent (AVX-512 CPUs take their wider paths).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define WIDELLM_AVX2 1
#endif

namespace widellm_cpu {

constexpr int64_t kCacheLine = 64;

// Ask for a cache block's bytes ahead of use: the blocks of a sequence are scattered over the
// pool, so the hardware prefetcher cannot guess where the next one starts.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += kCacheLine) __builtin_prefetch(c + i);
}

// n bf16 zeros (+0.0 is all-zero bits) with memset: std::fill on at::BFloat16 compiles to a
// loop of 2-byte stores.
inline void zero_bf16(at::BFloat16* p, int64_t n) {
  std::memset(static_cast<void*>(p), 0, n * sizeof(at::BFloat16));
}

// std::vector for kernel scratch whose resize() leaves new elements uninitialised (the default
// allocator zero-fills them, for bf16 one 2-byte store at a time: ~30% of the MLA decode
// kernel's time went to growing its per-call scratch). Every element must be written before
// it is read.
template <typename T>
struct UninitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() = default;
  template <typename U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using ScratchVector = std::vector<T, UninitAllocator<T>>;

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

// f(T{}) with T the element type of `type` (fp32, bf16 or fp16), so a kernel templated on T
// runs as `dispatch_float_types(x.scalar_type(), "op", [&](auto t) { op<decltype(t)>(...); })`;
// any other dtype fails naming `op`.
template <typename F>
inline void dispatch_float_types(at::ScalarType type, const char* op, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", type);
  }
}

template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

#if defined(__AVX512F__)
// 16 bf16 widened to fp32 (bf16 is the top half of an fp32).
inline __m512 load_bf16(const at::BFloat16* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#if defined(__AVX512BF16__)
// 16 fp32 rounded to bf16 by the CPU's own conversion: round to nearest even, as torch's casts
// (NaN stays NaN; inputs below fp32's normal range, ~1.2e-38, come out as zero, where torch
// keeps a bf16 subnormal). One instruction instead of the eight of the integer form below.
inline __m256i to_bf16_bits(__m512 v) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  __m256i bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
}
#endif

// 16 fp32 rounded to bf16 (to nearest even, as torch's casts; NaN stays NaN) and stored.
inline void store_bf16(at::BFloat16* dst, __m512 v) {
#if defined(__AVX512BF16__)
  const __m256i h = to_bf16_bits(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
  h = _mm256_mask_mov_epi16(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm256_set1_epi16(0x7FC0));
#endif
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
}

template <>
inline void row_to_float<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load_bf16(src + i));
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}
#elif defined(WIDELLM_AVX2)
template <>
inline void row_to_float<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}
#endif

// x rounded to T and back: the value torch holds after an op whose result is stored as T.
template <typename T>
inline float round_to(float x) { return to_float(static_cast<T>(x)); }

#if defined(__AVX512F__)
// round_to<BFloat16> for 16 lanes (round to nearest even; NaN stays NaN).
inline __m512 round_to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
#endif
}
#endif

// dst[:n] <- round_to<T>(src[:n]), still fp32.
template <typename T>
inline void round_row(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, round_to_bf16(_mm512_loadu_ps(src + i)));
  }
#endif
  for (; i < n; ++i) dst[i] = round_to<T>(src[i]);
}

// dst[:n] <- src[:n] rounded to T (round to nearest even, as torch's casts do).
template <typename T>
inline void row_from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

#if defined(__AVX512F__)
template <>
inline void row_from_float<at::BFloat16>(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store_bf16(dst + i, _mm512_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
}
#endif

#if defined(__AVX512F__)
// exp of 16 lanes: 2^k * e^r with k = round(x / ln 2), |r| <= ln(2) / 2, e^r by its Taylor
// series to r^6 (truncation < 2e-7 relative). Inputs are clamped to exp's finite fp32 range;
// softmax only feeds it x - max <= 0, where e^-88 and below count as 0 next to the sum >= 1.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - k ln2, with ln2 split in two so k * ln2_hi is exact.
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp16's method for 8 lanes (AVX-512 builds have it too, for the 8-lane fp32 prefill path);
// 2^k is built in the exponent field (AVX2 has no scalef): k is within [-127, 127] after the
// clamp, and 2^-127 comes out as 0, which softmax cannot tell from e^-88.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-88.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i two_k = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_k));
}

// The four lane-sums of a0..a3, in order.
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

#if defined(__AVX512F__)
// The 16 lane-sums of a[0..15], in order, as one vector: a transpose-and-add tree (unpack
// pairs, then 64-bit halves, then 128-bit lanes twice) instead of 16 separate reductions.
inline __m512 reduce16(const __m512* a) {
  __m512 c[4];
  for (int q = 0; q < 4; ++q) {
    const __m512* x = a + 4 * q;
    const __m512 b01 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 b23 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b01), _mm512_castps_pd(b23));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b01), _mm512_castps_pd(b23));
    c[q] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // lane L: x0..x3 sums of L
  }
  constexpr int kEven = 0x88, kOdd = 0xDD;  // 128-bit lanes (0, 2 | 0, 2) and (1, 3 | 1, 3)
  const __m512 f01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], kEven),
                                   _mm512_shuffle_f32x4(c[0], c[1], kOdd));
  const __m512 f23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], kEven),
                                   _mm512_shuffle_f32x4(c[2], c[3], kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f01, f23, kEven), _mm512_shuffle_f32x4(f01, f23, kOdd));
}

// Two rows of 32 bf16 as 32 (a[i], b[i]) pairs: i < 16 into lo, 16 <= i < 32 into hi. This is
// how two tokens' value rows meet a pair of probabilities in a bf16 dot product (one AMX B
// tile row, or one vdpbf16ps operand).
inline void interleave_pairs(__m512i a, __m512i b, __m512i& lo, __m512i& hi) {
  const __m512i lo_idx = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003,
                                           0x00240004, 0x00250005, 0x00260006, 0x00270007,
                                           0x00280008, 0x00290009, 0x002A000A, 0x002B000B,
                                           0x002C000C, 0x002D000D, 0x002E000E, 0x002F000F);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  lo = _mm512_permutex2var_epi16(a, lo_idx, b);
  hi = _mm512_permutex2var_epi16(a, hi_idx, b);
}
#endif

#if defined(__AVX512F__)
// silu(x) = x / (1 + e^-x) of 16 lanes, rounded to T as torch stores F.silu's result. For bf16
// the division is a reciprocal estimate and one Newton step (within an fp32 ulp or two, and
// the result is rounded to bf16's 8 bits anyway): a 512-bit divide costs as much as the exp.
template <typename T>
inline __m512 silu16(__m512 x) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
    return round_to_bf16(_mm512_mul_ps(x, r));
  }
  return _mm512_div_ps(x, d);
}
#endif

// g[:n] <- silu(g[:n]) * u[:n], rounded as torch rounds F.silu(g) * u in T: silu's result is
// stored as T before the product.
template <typename T>
inline void silu_mul_inplace(float* g, const float* u, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, float>) {
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(g + i, _mm512_mul_ps(silu16<T>(_mm512_loadu_ps(g + i)),
                                            _mm512_loadu_ps(u + i)));
  }
#elif defined(WIDELLM_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    // fp32 only (no bf16 rounding on these CPUs' paths): x / (1 + e^-x), divided exactly.
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
      const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.f), e);
      _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, d), _mm256_loadu_ps(u + i)));
    }
  }
#endif
  for (; i < n; ++i) g[i] = round_to<T>(g[i] / (1.f + std::exp(-g[i]))) * u[i];
}

// out[:n] <- silu(g[:n]) * u[:n] for bf16 rows: silu_mul_inplace's result, rounded to bf16,
// in one pass from and to bf16 (no fp32 copies of the rows).
inline void silu_mul_row_bf16(const at::BFloat16* g, const at::BFloat16* u, at::BFloat16* out,
                              int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    store_bf16(out + i, _mm512_mul_ps(silu16<at::BFloat16>(load_bf16(g + i)), load_bf16(u + i)));
#endif
  for (; i < n; ++i) {
    float gi = to_float(g[i]);
    const float ui = to_float(u[i]);
    silu_mul_inplace<at::BFloat16>(&gi, &ui, 1);
    out[i] = static_cast<at::BFloat16>(gi);
  }
}

// s[:n] <- softmax(s[:n]), n >= 1.
inline void softmax_inplace(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  float sum = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + i));
  m = _mm512_reduce_max_ps(vm);
#elif defined(WIDELLM_AVX2)
  __m256 vm = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + i));
  m = reduce_max8(vm);
#endif
  for (; i < n; ++i) m = std::max(m, s[i]);
  i = 0;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmax));
    _mm512_storeu_ps(s + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#elif defined(WIDELLM_AVX2)
  const __m256 vmax = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmax));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = reduce_add8(vsum);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  const float inv = 1.f / sum;
  for (i = 0; i < n; ++i) s[i] *= inv;
}

}  // namespace widellm_cpu
