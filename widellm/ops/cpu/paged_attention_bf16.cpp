// Paged decode attention for bf16 caches with AVX512-BF16 dot products: the path that
// paged_decode_attention (paged_attention.cpp) takes where paged_decode_bf16_supported says so.
//   out[b, h, g] = softmax_l(scale * q[b, h, g] . K[slot(b, l), h]) V[slot(b, l), h],  l < L_b
// One task per (sequence, KV head):
//   scores  each cached key row meets each query row of the group as bf16 pairs (vdpbf16ps,
//           fp32 sums), 16 rows at a time reduced together; no row is widened to fp32;
//   softmax per query row in fp32, probabilities rounded to bf16 (as torch's CPU flash
//           attention rounds them before its value product);
//   values  each pair of value rows interleaved in registers and multiplied by the
//           probability pair of each query row (vdpbf16ps), accumulated in fp32 registers.
// Why: the vector kernel widens every cached row to fp32 and spends about twice the time its
// bytes take to arrive on conversions and FMAs. SmolLM2's decode attention at 64 sequences of
// ~150 positions, per step (30 layers), alternating in one engine: 25-30 ms vector, 19-23 ms
// here; the rest is waiting for the scattered blocks (prefetched one block ahead).
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

using namespace widellm_cpu;
using bf16 = at::BFloat16;

constexpr int64_t kRows = 16;       // key rows per scoring pass: one reduce16
constexpr int64_t kPairCols = 32;   // bf16 values per 512-bit register
constexpr int kMaxGroupRows = 4;    // query rows accumulated together in the value pass
constexpr int kMaxColRegs = 4;      // fp32 output registers per query row in the value pass

#if defined(__AVX512BF16__)
struct CacheStrides {
  int64_t block, pos;  // element strides of one KV head's rows in a cache
};

struct HeadScratch {
  // Uninitialised growth (ScratchVector): sequences of different lengths alternate.
  ScratchVector<float> scores;  // [G][tokens rounded up to 16]
  ScratchVector<float> row;     // one query row's probabilities in fp32
  ScratchVector<bf16> probs;    // [G][tokens rounded up to 2]: bf16 pairs, zero past L
  ScratchVector<bf16> zero_row; // [Dv] zeros: the partner of an odd length's last token
};

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// Ask for `rows` cache rows of `bytes` each, `stride` elements apart. A head's rows of a block
// are strided and the blocks of a sequence scattered over the pool, so the hardware
// prefetchers do not find them: without this the kernel waits on memory row by row.
inline void prefetch_rows(const bf16* first, int64_t stride, int64_t rows, int64_t bytes) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = reinterpret_cast<const char*>(first + r * stride);
    for (int64_t i = 0; i < bytes; i += kCacheLine) _mm_prefetch(p + i, _MM_HINT_T0);
  }
}

// acc[g][c] += sum over the sequence's token pairs of probs[g] pair . values pair, for the
// kG query rows from g0 and the 16 * kC value columns from c0; then out rows written.
// probs [G][L2] bf16 (pairs of 32 bits), v_row(l) the value row of token l.
template <int kG, int kC, typename VRow>
void value_pass(const bf16* probs, int64_t L2, int64_t L, VRow v_row, int64_t vs_pos,
                const bf16* zero_row, int64_t g0, int64_t c0, int64_t Dv, bf16* out) {
  __m512 acc[kG][kC];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) acc[g][c] = _mm512_setzero_ps();
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(probs);
  for (int64_t l = 0; l < L; l += 2) {
    if (l % kRows == 0 && l + kRows < L)  // the next block's rows (16 positions ahead)
      prefetch_rows(v_row(l + kRows) + c0, vs_pos, std::min(kRows, L - l - kRows),
                    kC * 16 * sizeof(bf16));
    const bf16* r0 = v_row(l) + c0;
    const bf16* r1 = (l + 1 < L ? v_row(l + 1) : zero_row) + c0;
    __m512i v[kC];
    for (int c = 0; c < kC; c += 2)
      interleave_pairs(_mm512_loadu_si512(r0 + c / 2 * kPairCols),
                       _mm512_loadu_si512(r1 + c / 2 * kPairCols), v[c], v[c + 1]);
    for (int g = 0; g < kG; ++g) {
      const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(pairs[((g0 + g) * L2 + l) / 2])));
      for (int c = 0; c < kC; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], as_bh(v[c]), p);
    }
  }
  alignas(64) float tmp[16];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) {
      _mm512_store_ps(tmp, acc[g][c]);
      row_from_float(tmp, out + (g0 + g) * Dv + c0 + 16 * c, 16);
    }
}

template <int kC, typename VRow>
void value_pass_rows(int64_t rows, const bf16* probs, int64_t L2, int64_t L, VRow v_row,
                     int64_t vs_pos, const bf16* zero_row, int64_t g0, int64_t c0, int64_t Dv,
                     bf16* out) {
  switch (rows) {
    case 1: value_pass<1, kC>(probs, L2, L, v_row, vs_pos, zero_row, g0, c0, Dv, out); break;
    case 2: value_pass<2, kC>(probs, L2, L, v_row, vs_pos, zero_row, g0, c0, Dv, out); break;
    case 3: value_pass<3, kC>(probs, L2, L, v_row, vs_pos, zero_row, g0, c0, Dv, out); break;
    default: value_pass<kMaxGroupRows, kC>(probs, L2, L, v_row, vs_pos, zero_row, g0, c0, Dv, out);
  }
}

// Attention of the G query rows q [G][Dk] over one KV head's first L >= 1 cached positions;
// k and v point at the head's first element in the caches, blocks is the sequence's block
// table row. out [G][Dv].
void decode_head(const bf16* q, int64_t G, int64_t Dk, const bf16* k, CacheStrides ks,
                 const bf16* v, CacheStrides vs, int64_t Dv, const int64_t* blocks,
                 int64_t block_size, int64_t L, float scale, bf16* out, HeadScratch& s) {
  auto k_row = [&](int64_t l) {
    return k + blocks[l / block_size] * ks.block + (l % block_size) * ks.pos;
  };
  auto v_row = [&](int64_t l) {
    return v + blocks[l / block_size] * vs.block + (l % block_size) * vs.pos;
  };
  const int64_t L16 = (L + kRows - 1) / kRows * kRows;
  const int64_t L2 = (L + 1) / 2 * 2;

  // Scores, 16 key rows a pass. A pass never crosses a block (block_size is a multiple of
  // 16); rows past L are read (they lie inside the block) but their lanes are never used.
  s.scores.resize(G * L16);
  // Keys 16 positions ahead (one block) while these are scored; values in the value pass.
  const int64_t k_bytes = Dk * sizeof(bf16);
  prefetch_rows(k_row(0), ks.pos, std::min(kRows, L), k_bytes);
  for (int64_t t0 = 0; t0 < L; t0 += kRows) {
    if (t0 + kRows < L)
      prefetch_rows(k_row(t0 + kRows), ks.pos, std::min(kRows, L - t0 - kRows), k_bytes);
    const bf16* rows = k_row(t0);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[kRows];
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t d = 0; d < Dk; d += kPairCols) {
        const __m512bh qv = as_bh(_mm512_loadu_si512(q + g * Dk + d));
        for (int r = 0; r < kRows; ++r)
          acc[r] = _mm512_dpbf16_ps(acc[r], as_bh(_mm512_loadu_si512(rows + r * ks.pos + d)), qv);
      }
      _mm512_storeu_ps(s.scores.data() + g * L16 + t0, reduce16(acc));
    }
  }

  // Softmax per query row; probabilities rounded to bf16, zero past L.
  s.row.resize(L);
  s.probs.resize(G * L2);
  for (int64_t g = 0; g < G; ++g) {
    const float* sg = s.scores.data() + g * L16;
    for (int64_t l = 0; l < L; ++l) s.row[l] = sg[l] * scale;
    softmax_inplace(s.row.data(), L);
    bf16* pg = s.probs.data() + g * L2;
    row_from_float(s.row.data(), pg, L);
    std::fill(pg + L, pg + L2, bf16(0.f));
  }

  if (static_cast<int64_t>(s.zero_row.size()) != Dv) s.zero_row.assign(Dv, bf16(0.f));
  for (int64_t c0 = 0; c0 < Dv; c0 += kMaxColRegs * 16) {
    for (int64_t g0 = 0; g0 < G; g0 += kMaxGroupRows) {
      const int64_t rows = std::min<int64_t>(kMaxGroupRows, G - g0);
      if (Dv - c0 >= kMaxColRegs * 16)
        value_pass_rows<kMaxColRegs>(rows, s.probs.data(), L2, L, v_row, vs.pos,
                                     s.zero_row.data(), g0, c0, Dv, out);
      else  // Dv is a multiple of 32: the last 32 columns
        value_pass_rows<2>(rows, s.probs.data(), L2, L, v_row, vs.pos, s.zero_row.data(), g0, c0,
                           Dv, out);
    }
  }
}
#endif

}  // namespace

bool paged_decode_bf16_supported(int64_t block_size, int64_t group, int64_t head_size,
                                 int64_t v_head_size) {
#if defined(__AVX512BF16__)
  return block_size % kRows == 0 && group >= 1 && head_size % kPairCols == 0 &&
         v_head_size % kPairCols == 0;
#else
  (void)block_size;
  (void)group;
  (void)head_size;
  (void)v_head_size;
  return false;
#endif
}

// Shapes and checks as paged_decode_attention's (paged_attention.cpp), bf16 only, where
// paged_decode_bf16_supported(block_size, G, Dk, Dv). Writes out [B, Hkv, G, Dv].
void paged_decode_attention_bf16(torch::Tensor& out, const torch::Tensor& q,
                                 const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                                 double scale) {
#if defined(__AVX512BF16__)
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), Dk = q.size(3);
  const int64_t Dv = v_cache.size(3), block_size = k_cache.size(1);
  const int64_t max_blocks = block_table.size(1);
  const CacheStrides ks{k_cache.stride(0), k_cache.stride(1)};
  const CacheStrides vs{v_cache.stride(0), v_cache.stride(1)};
  const int64_t ks_h = k_cache.stride(2), vs_h = v_cache.stride(2);
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* kp = k_cache.data_ptr<bf16>();
  const bf16* vp = v_cache.data_ptr<bf16>();
  const int64_t* bt = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  bf16* op = out.data_ptr<bf16>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    HeadScratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H, L = lens[b];
      bf16* o = op + i * G * Dv;
      if (L == 0) {
        std::fill(o, o + G * Dv, bf16(0.f));
        continue;
      }
      decode_head(qp + i * G * Dk, G, Dk, kp + h * ks_h, ks, vp + h * vs_h, vs, Dv,
                  bt + b * max_blocks, block_size, L, fscale, o, scratch);
    }
  });
#else
  (void)out;
  (void)q;
  (void)k_cache;
  (void)v_cache;
  (void)block_table;
  (void)seq_lens;
  (void)scale;
  TORCH_CHECK(false, "paged_decode_attention_bf16: built without AVX512-BF16");
#endif
}
