// MLA decode attention over the paged latent cache with AMX tiles (bf16):
//   mla_decode_attention(q [B, H, Dk], cache [num_blocks, 16, Dk], block_table [B, max_blocks],
//                        seq_lens [B], Dv, scale) -> [B, H, Dv]
//   out[b, h] = softmax_l(scale * q[b, h] . C[slot(b, l)]) C[slot(b, l), :Dv],  l < seq_lens[b]
// with q the absorbed query (latent + rope parts) and C the cached latent rows, which are both
// the one key head every query head shares and, in their first Dv columns, the values.
// Rounded where the gather-and-bmm reference (widellm/layers/mla.py, _decode_absorbed) rounds:
// scores stored as bf16 before the scale and softmax (fp32), probabilities as bf16 before the
// value product, the output as bf16.
//
// Why: the reference gathers every sequence's context out of the cache, copies its value
// columns, and runs three small batched matmuls per layer; here each 16-token cache block is
// a score tile's A operand in place (16 tokens x 32 k per load), the 16 heads of a query the
// B operand, and the value product is a second tile product over the sequence's values,
// packed once in AMX's pair layout. Needs block size 16 and Dk, Dv multiples of 32.
#include "amx.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using namespace widellm_cpu;
using bf16 = at::BFloat16;

constexpr int64_t kBlockSize = 16;  // cache rows per block: one score tile's rows

#if WIDELLM_HAS_AMX
// Per-thread buffers of mla_decode_seq, reused from one sequence to the next.
struct SeqScratch {
  // Uninitialised on growth: each is written before it is read (zeroed where noted).
  ScratchVector<bf16> q_packed;   // [Dk / 2][16][2], one head chunk
  ScratchVector<float> scores;    // [blocks * 16][16]: token-major score tiles
  ScratchVector<bf16> probs;      // [16][tokens rounded up to 32]
  ScratchVector<bf16> v_packed;   // [tokens rounded up to 32 / 2][Dv][2]
  ScratchVector<float> row;       // one head's scores, then probabilities
  ScratchVector<bf16> zero_row;   // [Dv] zeros: the partner of an odd length's last token
};

// One sequence, all heads: out [H, Dv] for q [H, Dk]; blocks are its block-table row, L its
// length. Needs a TileScope.
void mla_decode_seq(const bf16* q, int64_t H, int64_t Dk, const bf16* cache,
                    const int64_t* blocks, int64_t L, int64_t Dv, float scale, bf16* out,
                    SeqScratch& s) {
  const int64_t num_blocks = (L + kBlockSize - 1) / kBlockSize;
  const int64_t L32 = (L + kTileK - 1) / kTileK * kTileK;  // k of the value product
  const int64_t block_elems = kBlockSize * Dk;
  auto row_at = [&](int64_t l) {
    return cache + blocks[l / kBlockSize] * block_elems + (l % kBlockSize) * Dk;
  };

  // Values, once for all heads: token pairs interleaved, zero past L (0 * garbage could be NaN).
  // Pairs up to L are written whole, so only the pairs after them are zeroed.
  const int64_t L2 = (L + 1) / 2 * 2;
  s.v_packed.resize(L32 * Dv);
  zero_bf16(s.v_packed.data() + L2 * Dv, (L32 - L2) * Dv);
  s.zero_row.resize(Dv);
  zero_bf16(s.zero_row.data(), Dv);
  for (int64_t l = 0; l < L; l += 2) {
    const bf16* r1 = l + 1 < L ? row_at(l + 1) : s.zero_row.data();
    interleave_rows(row_at(l), r1, Dv, s.v_packed.data() + l * Dv);
  }

  s.scores.resize(num_blocks * kBlockSize * kTile);
  s.probs.resize(kTile * L32);
  s.row.resize(std::max(L32, 2 * kTile));
  alignas(64) float tile[2 * kTile * kTile];
  for (int64_t h0 = 0; h0 < H; h0 += kTile) {
    const int64_t heads = std::min(kTile, H - h0);
    // Scores: C[token][head] = cache block rows (A, in place) x packed query heads (B).
    s.q_packed.resize(Dk * kTile);
    if (heads < kTile) zero_bf16(s.q_packed.data(), Dk * kTile);  // else every column is packed
    for (int64_t h = 0; h < heads; ++h) pack_row(q + (h0 + h) * Dk, Dk, s.q_packed.data(), h);
    for (int64_t i = 0; i < num_blocks; ++i) {
      const bf16* blk = cache + blocks[i] * block_elems;
      _tile_zero(0);
      for (int64_t k = 0; k < Dk; k += kTileK) {
        _tile_loadd(2, s.q_packed.data() + k * kTile, kTile * 2 * sizeof(bf16));
        _tile_loadd(3, blk + k, Dk * sizeof(bf16));
        _tile_dpbf16ps(0, 3, 2);
      }
      _tile_stored(0, s.scores.data() + i * kBlockSize * kTile, kTile * sizeof(float));
    }
    // Softmax per head over its L tokens; probabilities rounded to bf16, zero past L.
    zero_bf16(s.probs.data(), kTile * L32);
    for (int64_t h = 0; h < heads; ++h) {
      float* p = s.row.data();
      for (int64_t l = 0; l < L; ++l) p[l] = round_to<bf16>(s.scores[l * kTile + h]) * scale;
      softmax_inplace(p, L);
      row_from_float(p, s.probs.data() + h * L32, L);
    }
    // Values: C[head][n] = probs (A, 16 heads x 32 tokens) x packed values (B), 32 n a time.
    for (int64_t n0 = 0; n0 < Dv; n0 += 2 * kTile) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t l = 0; l < L32; l += kTileK) {
        _tile_loadd(2, s.probs.data() + l, L32 * sizeof(bf16));
        const bf16* v = s.v_packed.data() + l * Dv + 2 * n0;
        _tile_loadd(3, v, 2 * Dv * sizeof(bf16));
        _tile_loadd(4, v + 2 * kTile, 2 * Dv * sizeof(bf16));
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
      }
      _tile_stored(0, tile, 2 * kTile * sizeof(float));
      _tile_stored(1, tile + kTile, 2 * kTile * sizeof(float));
      for (int64_t h = 0; h < heads; ++h)
        row_from_float(tile + h * 2 * kTile, out + (h0 + h) * Dv + n0, 2 * kTile);
    }
  }
}
#endif

}  // namespace

bool mla_decode_supported(int64_t block_size, int64_t head_size, int64_t v_head_size) {
#if WIDELLM_HAS_AMX
  return block_size == kBlockSize && head_size % kTileK == 0 && v_head_size % kTileK == 0 &&
         v_head_size <= head_size && amx_ready();
#else
  (void)block_size;
  (void)head_size;
  (void)v_head_size;
  return false;
#endif
}

torch::Tensor mla_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_table,
                                   torch::Tensor seq_lens, int64_t v_head_size, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && cache.scalar_type() == at::kBFloat16,
              "mla_decode_attention: q and cache must be bf16");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 3 && q.is_contiguous() && cache.is_contiguous(),
              "mla_decode_attention: contiguous q [B, H, Dk] and cache [blocks, 16, Dk] expected");
  TORCH_CHECK(cache.size(2) == q.size(2), "mla_decode_attention: q and cache head sizes differ");
  TORCH_CHECK(mla_decode_supported(cache.size(1), q.size(2), v_head_size),
              "mla_decode_attention: needs AMX, block size 16 and head sizes multiples of 32");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.is_contiguous() &&
                  seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous() &&
                  block_table.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "mla_decode_attention: int64 block_table [B, max_blocks] and seq_lens [B] expected");
  const int64_t B = q.size(0), H = q.size(1), Dk = q.size(2);
  auto out = torch::empty({B, H, v_head_size}, q.options());
#if WIDELLM_HAS_AMX
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* cp = cache.data_ptr<bf16>();
  const int64_t* bt = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_table.size(1), num_cache_blocks = cache.size(0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 1 && lens[b] <= max_blocks * kBlockSize,
                      "mla_decode_attention: seq_lens[", b, "] out of range");
    for (int64_t i = 0; i < (lens[b] + kBlockSize - 1) / kBlockSize; ++i)
      TORCH_CHECK_VALUE(bt[b * max_blocks + i] >= 0 && bt[b * max_blocks + i] < num_cache_blocks,
                        "mla_decode_attention: block id out of range");
  }
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    TileScope tiles;
    SeqScratch scratch;
    for (int64_t b = begin; b < end; ++b)
      mla_decode_seq(qp + b * H * Dk, H, Dk, cp, bt + b * max_blocks, lens[b], v_head_size,
                     static_cast<float>(scale), op + b * H * v_head_size, scratch);
  });
#endif
  return out;
}
