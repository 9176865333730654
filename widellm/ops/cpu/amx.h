// AMX tile products with the weight as the A operand, as stored: a row-major weight [N, K]
// is 16 weight rows x 32 k per tile load, so no weight is repacked or transposed. The
// activation rows are the B operand, packed once per call in AMX's pair layout, 16 rows per
// chunk; one tile product does 16 x 16 x 32 multiply-adds and the result comes out
// transposed ([weight row][activation row]). Used by the routed-expert kernel (moe.cpp), where
// each expert's weight meets a few rows and reading it once is all the time there is. The
// attention kernels (mla_decode.cpp, prefill_attention.cpp) interleave value rows into the
// pair layout with interleave_rows.
//
// The pair layout and its packing helpers (kTile, packed_at, pack_row, interleave_rows) exist
// on AVX-512 CPUs without AMX too: a 512-bit register holds one packed row of 16 bf16 pairs,
// the operand of AVX512-BF16's vdpbf16ps, so vector kernels read the same packing.
#pragma once

#include "vec.h"

#include <torch/types.h>

#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define WIDELLM_HAS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define WIDELLM_HAS_AMX 0
#endif

namespace widellm_cpu {

#if defined(__AVX512F__)
constexpr int64_t kTile = 16;      // rows of every tile; 16 fp32 or 16 bf16 pairs per tile row
constexpr int64_t kTileK = 32;     // k of one tile product

// Offset of x[m][k] in a chunk of 16 rows packed as AMX's B operand: [K / 2][16][2].
inline int64_t packed_at(int64_t m, int64_t k) { return ((k >> 1) * kTile + m) * 2 + (k & 1); }

// Row m (< 16) of a packed chunk <- src[:K] (K even).
inline void pack_row(const at::BFloat16* src, int64_t K, at::BFloat16* chunk, int64_t m) {
  for (int64_t k = 0; k < K; k += 2)
    std::memcpy(chunk + packed_at(m, k), src + k, 2 * sizeof(at::BFloat16));
}

// dst[p][n][0..1] = (src0[n], src1[n]) for n < D: two value rows interleaved into one row of
// AMX's B layout over tokens (D a multiple of 32).
inline void interleave_rows(const at::BFloat16* src0, const at::BFloat16* src1, int64_t D,
                            at::BFloat16* dst) {
  for (int64_t n = 0; n < D; n += 32) {
    __m512i lo, hi;
    interleave_pairs(_mm512_loadu_si512(src0 + n), _mm512_loadu_si512(src1 + n), lo, hi);
    _mm512_storeu_si512(dst + 2 * n, lo);
    _mm512_storeu_si512(dst + 2 * n + 32, hi);
  }
}
#endif

#if WIDELLM_HAS_AMX
constexpr int64_t kTileCols = 32;  // weight rows of one amx_rows32 call (two result tiles)

// Linux hands out AMX state only to a process that asks for it (once per process); false
// where the kernel or hypervisor does not allow it.
inline bool amx_ready() {
  static const bool ready = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures every tile as 16 rows x 64 bytes for this thread while in scope.
struct TileScope {
  TileScope() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = kTile;
    }
    // Not _tile_loadconfig: GCC 12's version tells the compiler it reads one byte of the
    // config, and the stores of the tile shapes were dropped as dead (tiles then fault).
    asm volatile("ldtilecfg %0" : : "m"(cfg));
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// out[n][m] ([32][16] fp32) = sum_k w[n * ldw + k] * chunk[m][k] for the 32 weight rows at w;
// K a multiple of 32. Needs a TileScope.
inline void amx_rows32(const at::BFloat16* w, int64_t ldw, const at::BFloat16* chunk, int64_t K,
                       float* out) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < K; k += kTileK) {
    _tile_loadd(2, chunk + k * kTile, kTile * 2 * sizeof(at::BFloat16));
    _tile_loadd(3, w + k, ldw * sizeof(at::BFloat16));
    _tile_loadd(4, w + kTile * ldw + k, ldw * sizeof(at::BFloat16));
    _tile_dpbf16ps(0, 3, 2);
    _tile_dpbf16ps(1, 4, 2);
  }
  _tile_stored(0, out, kTile * sizeof(float));
  _tile_stored(1, out + kTile * kTile, kTile * sizeof(float));
}

// dst[:32] <- column m of a [32][16] amx_rows32 result (activation row m's 32 outputs).
inline void tile_column(const float* tile, int64_t m, float* dst) {
  // Two 16-lane gathers (stride 16 floats) instead of 32 scalar loads.
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(kTile)));
  _mm512_storeu_ps(dst, _mm512_i32gather_ps(rows, tile + m, sizeof(float)));
  _mm512_storeu_ps(dst + kTile, _mm512_i32gather_ps(rows, tile + kTile * kTile + m, sizeof(float)));
}
#endif

}  // namespace widellm_cpu
