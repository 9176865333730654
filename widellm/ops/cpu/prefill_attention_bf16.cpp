// bf16 path of the causal prefill kernel (the contract: prefill_attention.cpp; the path's
// members: prefill_attention.h), with AMX tiles or AVX512-BF16 dot products:
//   1. pack, per KV head: keys as AMX B tiles ([L / 16][Dk / 2][16][2]) and value rows
//      interleaved in pairs ([L / 2][Dv][2]), zero past L;
//   2. attend, per block of 16 queries of one query head: scores = query rows (A, read in
//      place) x key tiles, up to the block's last position; softmax per query row in fp32 over
//      its causal prefix, probabilities rounded to bf16 (as torch's CPU flash attention rounds
//      them); out = probabilities (A) x value pairs (B), accumulated in fp32, rounded to bf16.
//
// Why: torch's flash attention on this CPU runs the prompt at ~150 GFLOP/s (SmolLM2, 16 prompts
// of 256 tokens: ~18% of a 4,096-token prefill step); tile products reach several times that.
//
// CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and 5) run the same steps on the same packing
// with vdpbf16ps: a packed key row of 16 pairs, or a row of 16 value pairs, is one 512-bit
// operand, met by a query pair (scores) or a probability pair (values) broadcast to every lane;
// 6 query rows x 64 keys or columns accumulate in 24 of the 32 registers (10% faster than 4
// rows x 64 for SmolLM2's 16 x 256 prompts on Zen 5).
#include "prefill_attention.h"

#include "amx.h"
#include "vec.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AVX512BF16__)
namespace widellm_cpu::prefill {
namespace {

using bf16 = at::BFloat16;
static_assert(kBlock == kTile, "a block of queries is one tile's rows");
static_assert(kPackChunk % kTileK == 0, "packing tasks start on a pair of tiles");

constexpr int kGroupRows = 6;     // query rows the vector path accumulates together
constexpr int kGroupVectors = 4;  // 16-wide key or value-column vectors per pass

// p[:len] <- exp(scale * (s[j] - max_j s[j])) rounded to bf16, p[len:K32] <- 0; returns the
// sum of the exps in fp32 (the row is normalised after the value product, as flash attention
// does: two passes over the scores instead of five).
inline float exp_row(const float* s, int64_t len, float scale, bf16* p, int64_t K32) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - j)) - 1);
  vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, s + j));
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * scale);
  __m512 vsum = _mm512_setzero_ps();
  for (j = 0; j < K32; j += 16) {
    const int64_t left = std::clamp<int64_t>(len - j, 0, 16);
    const __mmask16 valid = static_cast<__mmask16>((1u << left) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(valid, s + j);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_fmsub_ps(x, vscale, shift)));
    vsum = _mm512_add_ps(vsum, e);
    store_bf16(p + j, e);
  }
  return _mm512_reduce_add_ps(vsum);
}

struct BlockScratch {
  // Uninitialised growth: the blocks of a task alternate small and large, and a zero-filling
  // resize then rewrote the probabilities on every large block (~30% of the kernel's time).
  ScratchVector<bf16> q_rows;   // [16][Dk]: a last block of fewer than 16 queries, zero padded
  ScratchVector<float> scores;  // [16][lds]: keys rounded up to 16, then one line of padding
  ScratchVector<bf16> probs;    // [16][ldp], likewise from 32; rows past the block's: stale
  float inv_sum[kTile];         // 1 / the sum of each query row's exps
};

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// The bf16 pair p[0..1] in every lane.
inline __m512bh pair_at(const bf16* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return as_bh(_mm512_set1_epi32(bits));
}

// scores[r][k0 + j] (row stride lds) <- q row r . key k0 + j for r < kR, j < 16 * kC: kR query
// rows (row stride q_stride) against kC packed 16-key chunks from k0 (a multiple of 16).
template <int kR, int kC>
void score_vectors(const bf16* q, int64_t q_stride, const bf16* k_packed, int64_t k0, int64_t Dk,
                   float* scores, int64_t lds) {
  __m512 acc[kR][kC];
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c) acc[r][c] = _mm512_setzero_ps();
  const bf16* chunk = k_packed + k0 * Dk;  // a 16-key chunk is [Dk / 2][16][2]
  for (int64_t d = 0; d < Dk; d += 2) {
    __m512bh keys[kC];
    for (int c = 0; c < kC; ++c)
      keys[c] = as_bh(_mm512_loadu_si512(chunk + c * kTile * Dk + d * kTile));
    for (int r = 0; r < kR; ++r) {
      const __m512bh pair = pair_at(q + r * q_stride + d);
      for (int c = 0; c < kC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pair, keys[c]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c) _mm512_storeu_ps(scores + r * lds + k0 + c * kTile, acc[r][c]);
}

// score_vectors over keys [0, keys rounded up to 16) for kR query rows.
template <int kR>
void score_rows(const bf16* q, int64_t q_stride, const bf16* k_packed, int64_t keys, int64_t Dk,
                float* scores, int64_t lds) {
  const int64_t K16 = (keys + kTile - 1) / kTile * kTile;
  int64_t k0 = 0;
  for (; k0 + kGroupVectors * kTile <= K16; k0 += kGroupVectors * kTile)
    score_vectors<kR, kGroupVectors>(q, q_stride, k_packed, k0, Dk, scores, lds);
  switch ((K16 - k0) / kTile) {
    case 3: score_vectors<kR, 3>(q, q_stride, k_packed, k0, Dk, scores, lds); break;
    case 2: score_vectors<kR, 2>(q, q_stride, k_packed, k0, Dk, scores, lds); break;
    case 1: score_vectors<kR, 1>(q, q_stride, k_packed, k0, Dk, scores, lds); break;
    default: break;
  }
}

// The vector path's scores of a block: rows [0, n) of queries at positions p0 + r, each group
// of rows up to its last row's causal prefix.
void score_block_vectors(const bf16* q, int64_t q_stride, int64_t n, int64_t p0,
                         const bf16* k_packed, int64_t Dk, float* scores, int64_t lds) {
  for_row_groups<kGroupRows>(n, [&](auto rows, int64_t r) {
    constexpr int kR = decltype(rows)::value;
    score_rows<kR>(q + r * q_stride, q_stride, k_packed, p0 + r + kR, Dk, scores + r * lds, lds);
  });
}

// out rows [0, kR) (row stride out_row), columns [c0, c0 + 16 * kC) <- row_scale[r] *
// (probs rows (row stride ldp) x value pairs) over positions [0, K2), K2 even.
template <int kR, int kC>
void value_vectors(const bf16* probs, int64_t ldp, int64_t K2, const bf16* v_pairs, int64_t Dv,
                   int64_t c0, const float* row_scale, bf16* out, int64_t out_row) {
  __m512 acc[kR][kC];
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t l = 0; l < K2; l += 2) {
    const bf16* pairs = v_pairs + l * Dv + 2 * c0;  // row l / 2 of [L / 2][Dv][2]
    __m512bh values[kC];
    for (int c = 0; c < kC; ++c) values[c] = as_bh(_mm512_loadu_si512(pairs + c * 2 * kTile));
    for (int r = 0; r < kR; ++r) {
      const __m512bh p = pair_at(probs + r * ldp + l);
      for (int c = 0; c < kC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, values[c]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c)
      store_bf16(out + r * out_row + c0 + c * kTile,
                 _mm512_mul_ps(acc[r][c], _mm512_set1_ps(row_scale[r])));
}

// value_vectors over every column (Dv a multiple of 32) for kR rows whose causal prefixes end
// before `keys`.
template <int kR>
void value_rows(const bf16* probs, int64_t ldp, int64_t keys, const bf16* v_pairs, int64_t Dv,
                const float* row_scale, bf16* out, int64_t out_row) {
  const int64_t K2 = (keys + 1) / 2 * 2;
  int64_t c0 = 0;
  for (; c0 + kGroupVectors * kTile <= Dv; c0 += kGroupVectors * kTile)
    value_vectors<kR, kGroupVectors>(probs, ldp, K2, v_pairs, Dv, c0, row_scale, out, out_row);
  if (c0 < Dv) value_vectors<kR, 2>(probs, ldp, K2, v_pairs, Dv, c0, row_scale, out, out_row);
}

// The vector path's output rows [0, n) of a block (queries at positions p0 + r).
void value_block_vectors(const bf16* probs, int64_t ldp, int64_t n, int64_t p0,
                         const bf16* v_pairs, int64_t Dv, const float* row_scale, bf16* out,
                         int64_t out_row) {
  for_row_groups<kGroupRows>(n, [&](auto rows, int64_t r) {
    constexpr int kR = decltype(rows)::value;
    value_rows<kR>(probs + r * ldp, ldp, p0 + r + kR, v_pairs, Dv, row_scale + r,
                   out + r * out_row, out_row);
  });
}

#if WIDELLM_HAS_AMX
// out rows [0, n) (n <= 16) <- row_scale[r] * (probs [16][K32] (row stride ldp) x value
// pairs), columns [c0, c0 + 16 * kTiles).
template <int kTiles>
void value_pass(const bf16* probs, int64_t K32, int64_t ldp, const bf16* v_pairs, int64_t Dv,
                int64_t c0, int64_t n, const float* row_scale, bf16* out, int64_t out_row) {
  static_assert(kTiles == 2 || kTiles == 4, "32 or 64 value columns per pass");
  const int64_t stride = 2 * Dv * sizeof(bf16);
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTiles == 4) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t l = 0; l < K32; l += kTileK) {
    _tile_loadd(4, probs + l, ldp * sizeof(bf16));
    const bf16* vp = v_pairs + l * Dv + 2 * c0;
    _tile_loadd(5, vp, stride);
    _tile_loadd(6, vp + 2 * kTile, stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (kTiles == 4) {
      _tile_loadd(7, vp + 4 * kTile, stride);
      _tile_loadd(5, vp + 6 * kTile, stride);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  alignas(64) float tile[kTiles][kTile * kTile];
  _tile_stored(0, tile[0], kTile * sizeof(float));
  _tile_stored(1, tile[1], kTile * sizeof(float));
  if constexpr (kTiles == 4) {
    _tile_stored(2, tile[2], kTile * sizeof(float));
    _tile_stored(3, tile[3], kTile * sizeof(float));
  }
  alignas(64) float scaled[kTile];
  for (int64_t r = 0; r < n; ++r)
    for (int j = 0; j < kTiles; ++j) {
      const __m512 x = _mm512_load_ps(tile[j] + r * kTile);
      _mm512_store_ps(scaled, _mm512_mul_ps(x, _mm512_set1_ps(row_scale[r])));
      row_from_float(scaled, out + r * out_row + c0 + j * kTile, kTile);
    }
}

// scores [16][keys rounded up to 16] (row stride lds) <- 16 query rows (A, row stride
// q_stride) x key tiles, for the first `keys` keys. kD = Dk / 32 query tiles stay loaded
// (tiles 4..7) across the key tiles; kD = 0 (Dk over 128) reloads them for each key tile.
// Needs a TileScope.
template <int kD>
void score_tiles(const bf16* q, int64_t q_stride, const bf16* k_packed, int64_t keys,
                 int64_t Dk, float* scores, int64_t lds) {
  static_assert(kD >= 0 && kD <= 4, "at most four resident query tiles");
  const int64_t qs = q_stride * sizeof(bf16), ks = kTile * 2 * sizeof(bf16);
  if constexpr (kD >= 1) _tile_loadd(4, q, qs);
  if constexpr (kD >= 2) _tile_loadd(5, q + kTileK, qs);
  if constexpr (kD >= 3) _tile_loadd(6, q + 2 * kTileK, qs);
  if constexpr (kD >= 4) _tile_loadd(7, q + 3 * kTileK, qs);
  for (int64_t k0 = 0; k0 < keys; k0 += kTile) {
    const bf16* kt = k_packed + k0 * Dk;
    _tile_zero(0);
    if constexpr (kD == 0) {
      for (int64_t d = 0; d < Dk; d += kTileK) {
        _tile_loadd(1, q + d, qs);
        _tile_loadd(2, kt + d * kTile, ks);
        _tile_dpbf16ps(0, 1, 2);
      }
    } else {
      _tile_loadd(1, kt, ks);
      _tile_dpbf16ps(0, 4, 1);
      if constexpr (kD >= 2) {
        _tile_loadd(2, kt + kTileK * kTile, ks);
        _tile_dpbf16ps(0, 5, 2);
      }
      if constexpr (kD >= 3) {
        _tile_loadd(1, kt + 2 * kTileK * kTile, ks);
        _tile_dpbf16ps(0, 6, 1);
      }
      if constexpr (kD >= 4) {
        _tile_loadd(2, kt + 3 * kTileK * kTile, ks);
        _tile_dpbf16ps(0, 7, 2);
      }
    }
    _tile_stored(0, scores + k0, lds * sizeof(float));
  }
}

#endif  // WIDELLM_HAS_AMX

}  // namespace

template <>
int64_t PrefillPath<bf16>::key_elems(int64_t L, int64_t Dk) {
  return (L + kTile - 1) / kTile * kTile * Dk;
}

template <>
int64_t PrefillPath<bf16>::value_elems(int64_t L, int64_t Dv) {
  return (L + kTileK - 1) / kTileK * kTileK * Dv;
}

template <>
void PrefillPath<bf16>::pack(RowView<bf16> k, RowView<bf16> v, int64_t l0, int64_t l1, int64_t L,
                             int64_t Dk, int64_t Dv, bf16* k_packed, bf16* v_pairs) {
  for (int64_t l = l0; l < l1; ++l)
    pack_row(k.data + l * k.row, Dk, k_packed + l / kTile * kTile * Dk, l % kTile);
  const std::vector<bf16> zero(Dv, bf16(0.f));
  for (int64_t l = l0; l < l1; l += 2) {
    const bf16* partner = l + 1 < L ? v.data + (l + 1) * v.row : zero.data();
    interleave_rows(v.data + l * v.row, partner, Dv, v_pairs + l * Dv);
  }
  if (l1 == L) {
    const int64_t L16 = (L + kTile - 1) / kTile * kTile;
    for (int64_t l = L; l < L16; ++l)
      for (int64_t d = 0; d < Dk; d += 2)
        std::fill_n(k_packed + l / kTile * kTile * Dk + packed_at(l % kTile, d), 2, bf16(0.f));
    std::fill(v_pairs + (L + 1) / 2 * 2 * Dv, v_pairs + value_elems(L, Dv), bf16(0.f));
  }
}

template <>
struct PrefillPath<bf16>::Worker {
  bool amx;
#if WIDELLM_HAS_AMX
  std::optional<TileScope> tiles;  // configured on the worker's thread, released with it
#endif
  BlockScratch scratch;
};

template <>
PrefillPath<bf16>::PrefillPath(bool amx) : worker_(std::make_unique<Worker>()) {
  worker_->amx = amx;
#if WIDELLM_HAS_AMX
  if (amx) worker_->tiles.emplace();
#endif
}

template <>
PrefillPath<bf16>::~PrefillPath() = default;

template <>
void PrefillPath<bf16>::attend(RowView<bf16> q, int64_t i0, int64_t n, int64_t p0,
                               const bf16* k_packed, const bf16* v_pairs, int64_t Dk, int64_t Dv,
                               float scale, bf16* out, int64_t out_row) {
  [[maybe_unused]] const bool amx = worker_->amx;
  BlockScratch& s = worker_->scratch;
  const int64_t keys = p0 + n;  // the last query sees positions [0, p0 + n)
  const int64_t K16 = (keys + kTile - 1) / kTile * kTile;
  const int64_t K32 = (keys + kTileK - 1) / kTileK * kTileK;
  // Row strides one cache line past the rows: long rows a multiple of 4 KiB apart would all
  // fall in one L1 set (16 rows of a tile, 12 ways), which made 2,048-token prompts slower.
  const int64_t lds = K16 + kTile, ldp = K32 + kTileK;
  const bf16* qa = q.data + i0 * q.row;
  s.scores.resize(kTile * lds);
#if WIDELLM_HAS_AMX
  if (amx) {
    int64_t q_stride = q.row;
    if (n < kTile) {  // the tile load reads 16 rows: stage the last block's rows
      s.q_rows.resize(kTile * Dk);
      zero_bf16(s.q_rows.data() + n * Dk, (kTile - n) * Dk);
      for (int64_t r = 0; r < n; ++r) std::copy_n(qa + r * q.row, Dk, s.q_rows.data() + r * Dk);
      qa = s.q_rows.data();
      q_stride = Dk;
    }
    // Scores [query][key], one 16 x 16 tile per 16 keys.
    switch (Dk / kTileK) {
      case 1: score_tiles<1>(qa, q_stride, k_packed, keys, Dk, s.scores.data(), lds); break;
      case 2: score_tiles<2>(qa, q_stride, k_packed, keys, Dk, s.scores.data(), lds); break;
      case 3: score_tiles<3>(qa, q_stride, k_packed, keys, Dk, s.scores.data(), lds); break;
      case 4: score_tiles<4>(qa, q_stride, k_packed, keys, Dk, s.scores.data(), lds); break;
      default: score_tiles<0>(qa, q_stride, k_packed, keys, Dk, s.scores.data(), lds);
    }
  } else
#endif
  {
    score_block_vectors(qa, q.row, n, p0, k_packed, Dk, s.scores.data(), lds);
  }

  // Softmax of each query over its causal prefix: bf16 exps, zero past it; the division by
  // their sum is applied to the output rows.
  s.probs.resize(kTile * ldp);
  for (int64_t r = 0; r < n; ++r)
    s.inv_sum[r] = 1.f / exp_row(s.scores.data() + r * lds, p0 + r + 1, scale,
                                 s.probs.data() + r * ldp, K32);

#if WIDELLM_HAS_AMX
  if (amx) {
    int64_t c0 = 0;
    for (; c0 + 4 * kTile <= Dv; c0 += 4 * kTile)
      value_pass<4>(s.probs.data(), K32, ldp, v_pairs, Dv, c0, n, s.inv_sum, out + i0 * out_row,
                    out_row);
    if (c0 < Dv)
      value_pass<2>(s.probs.data(), K32, ldp, v_pairs, Dv, c0, n, s.inv_sum, out + i0 * out_row,
                    out_row);
    return;
  }
#endif
  value_block_vectors(s.probs.data(), ldp, n, p0, v_pairs, Dv, s.inv_sum, out + i0 * out_row,
                      out_row);
}

}  // namespace widellm_cpu::prefill
#endif  // __AVX512BF16__
