// Routed experts in one call (bf16):
//   fused_experts(hidden [N, H], expert_ids [N], w13 [E, 2I, H], w2 [E, H, I]) -> [N, H]
//   out[r] = w2[e] @ silu(w13[e][:I] @ hidden[r]) * (w13[e][I:] @ hidden[r]), e = expert_ids[r];
//   rows with expert id -1 come out as zeros.
// Rounded where the torch reference (widellm/layers/moe/experts.py) rounds: gate and up are
// stored as bf16 before the SiLU, SiLU's result before the product, the product before the
// down projection. Only the order of the fp32 sums inside each dot product differs.
//
// Why a kernel: at decode each expert gets a handful of rows and the time goes into reading
// its weights. A task here streams one block of one expert's weight rows once and multiplies
// it with every row routed to that expert, so each weight is read once per step however
// skewed the routing is, with no per-expert Python call, no padding rows and no [E, P, H]
// grid. Two paths: AMX tile products (amx.h; H and I multiples of 32), faster than the
// grouped library matmuls at every batch size measured, and AVX512-BF16 dot products for
// other sizes and CPUs without AMX, which the caller uses for decode-sized batches only.
#include "amx.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace widellm_cpu;
using bf16 = at::BFloat16;

// Output columns of one expert per task: 32 weight rows (64 KB at H = 1024) per task keep
// both cores streaming with little scheduling cost.
constexpr int64_t kColsPerTask = 32;

#if defined(__AVX512BF16__)
constexpr bool kHasFusedExperts = true;

// Rows x weight rows of one register tile: 16 fp32 accumulators, 4 + 1 loads per 32 k.
constexpr int kRowTile = 4;
constexpr int kColTile = 4;

// out[m * ldo + n] = sum_k x[m][k] * w[n * ldw + k] for M rows and NC weight rows.
template <int M, int NC>
inline void dot_tile(const bf16* const* x, const bf16* w, int64_t ldw, int64_t K, float* out,
                     int64_t ldo) {
  __m512 acc[M][NC];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < NC; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    // Masked loads zero the lanes past K, whose products then add nothing.
    const __mmask32 mask = K - k >= 32 ? ~__mmask32{0} : (__mmask32{1} << (K - k)) - 1;
    __m512bh wv[NC];
    for (int n = 0; n < NC; ++n) wv[n] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + n * ldw + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[m] + k);
      for (int n = 0; n < NC; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < NC; ++n) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m][n]);
}

template <int NC>
inline void dot_rows(int rows, const bf16* const* x, const bf16* w, int64_t ldw, int64_t K,
                     float* out, int64_t ldo) {
  switch (rows) {
    case 1: dot_tile<1, NC>(x, w, ldw, K, out, ldo); break;
    case 2: dot_tile<2, NC>(x, w, ldw, K, out, ldo); break;
    case 3: dot_tile<3, NC>(x, w, ldw, K, out, ldo); break;
    default: dot_tile<4, NC>(x, w, ldw, K, out, ldo); break;
  }
}

// out[r * cols + c] = dot(x[r][:K], w[c * ldw :][:K]) for r < R, c < cols. Each tile of kColTile
// weight rows stays in L1 while every row multiplies it.
void matmul_rows(const bf16* const* x, int64_t R, const bf16* w, int64_t ldw, int64_t cols,
                 int64_t K, float* out) {
  for (int64_t c = 0; c < cols; c += kColTile) {
    const bool full = cols - c >= kColTile;
    for (int64_t r = 0; r < R; r += kRowTile) {
      const int m = static_cast<int>(std::min<int64_t>(kRowTile, R - r));
      if (full) {
        dot_rows<kColTile>(m, x + r, w + c * ldw, ldw, K, out + r * cols + c, cols);
      } else {
        for (int64_t cc = c; cc < cols; ++cc)
          dot_rows<1>(m, x + r, w + cc * ldw, ldw, K, out + r * cols + cc, cols);
      }
    }
  }
}
#else
constexpr bool kHasFusedExperts = false;

void matmul_rows(const bf16* const*, int64_t, const bf16*, int64_t, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "fused_experts: this CPU has no AVX512-BF16");
}
#endif

// One task: output columns [col, col + cols) of one expert, for that expert's rows.
struct Task {
  int64_t expert;
  int64_t col;
};

std::vector<Task> make_tasks(const std::vector<int64_t>& counts, int64_t width) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    if (counts[e] == 0) continue;
    for (int64_t c = 0; c < width; c += kColsPerTask) tasks.push_back({e, c});
  }
  return tasks;
}

// The rows of each expert: order[starts[e] : starts[e + 1]] are expert e's row indices, in
// input order (a counting sort); rows with id -1 are listed in skipped.
struct Routing {
  std::vector<int64_t> counts, starts, order, skipped;
};

Routing sort_rows(const torch::Tensor& expert_ids, int64_t num_experts) {
  const auto ids = expert_ids.contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int64_t num_rows = ids.size(0);
  Routing routing{std::vector<int64_t>(num_experts, 0), std::vector<int64_t>(num_experts + 1, 0),
                  {}, {}};
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK_VALUE(idp[r] >= -1 && idp[r] < num_experts, "expert id ", idp[r],
                      " out of range for ", num_experts, " local experts");
    if (idp[r] >= 0) {
      ++routing.counts[idp[r]];
    } else {
      routing.skipped.push_back(r);
    }
  }
  for (int64_t e = 0; e < num_experts; ++e)
    routing.starts[e + 1] = routing.starts[e] + routing.counts[e];
  routing.order.resize(routing.starts[num_experts]);
  std::vector<int64_t> next(routing.starts.begin(), routing.starts.end() - 1);
  for (int64_t r = 0; r < num_rows; ++r)
    if (idp[r] >= 0) routing.order[next[idp[r]]++] = r;
  return routing;
}

// Rounds gate and up as torch stores them, then act[:cols] <- silu(gate) * up in bf16.
inline void gate_row(float* gate, float* up, int64_t cols, bf16* act) {
  round_row<bf16>(gate, gate, cols);
  round_row<bf16>(up, up, cols);
  silu_mul_inplace<bf16>(gate, up, cols);
  row_from_float(gate, act, cols);
}

// Both projections with the dot-product tiles above; any H and I.
void experts_dot(const bf16* xp, const Routing& rt, const bf16* w13p, const bf16* w2p,
                 int64_t hidden_size, int64_t inter, bf16* actp, bf16* outp) {
  // Gate/up: act[rows of e][col:] = silu_and_mul of both halves' columns [col, col + cols).
  const auto up_tasks = make_tasks(rt.counts, inter);
  at::parallel_for(0, static_cast<int64_t>(up_tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<const bf16*> rows;
    std::vector<float> gate, up;
    for (int64_t t = begin; t < end; ++t) {
      const auto [e, col] = up_tasks[t];
      const int64_t R = rt.counts[e], cols = std::min(kColsPerTask, inter - col);
      rows.resize(R);
      for (int64_t r = 0; r < R; ++r) rows[r] = xp + rt.order[rt.starts[e] + r] * hidden_size;
      gate.resize(R * cols);
      up.resize(R * cols);
      const bf16* we = w13p + e * 2 * inter * hidden_size;
      matmul_rows(rows.data(), R, we + col * hidden_size, hidden_size, cols, hidden_size,
                  gate.data());
      matmul_rows(rows.data(), R, we + (inter + col) * hidden_size, hidden_size, cols,
                  hidden_size, up.data());
      for (int64_t r = 0; r < R; ++r)
        gate_row(gate.data() + r * cols, up.data() + r * cols, cols,
                 actp + (rt.starts[e] + r) * inter + col);
    }
  });

  // Down: out[row][col:] = act[row] @ w2[e][col : col + cols].T, written in the input order.
  const auto down_tasks = make_tasks(rt.counts, hidden_size);
  at::parallel_for(0, static_cast<int64_t>(down_tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<const bf16*> rows;
    std::vector<float> acc;
    for (int64_t t = begin; t < end; ++t) {
      const auto [e, col] = down_tasks[t];
      const int64_t R = rt.counts[e], cols = std::min(kColsPerTask, hidden_size - col);
      rows.resize(R);
      for (int64_t r = 0; r < R; ++r) rows[r] = actp + (rt.starts[e] + r) * inter;
      acc.resize(R * cols);
      matmul_rows(rows.data(), R, w2p + (e * hidden_size + col) * inter, inter, cols, inter,
                  acc.data());
      for (int64_t r = 0; r < R; ++r)
        row_from_float(acc.data() + r * cols,
                       outp + rt.order[rt.starts[e] + r] * hidden_size + col, cols);
    }
  });
}

#if WIDELLM_HAS_AMX
static_assert(kColsPerTask == kTileCols, "a task is the weight rows of one amx_rows32 call");

void experts_amx(const bf16* xp, const Routing& rt, const bf16* w13p, const bf16* w2p,
                 int64_t hidden_size, int64_t inter, bf16* outp) {
  const int64_t num_experts = static_cast<int64_t>(rt.counts.size());
  // First 16-row chunk of each expert. The padding rows of an expert's last chunk are left
  // uninitialized: a row of the B operand only feeds its own column of the result, and those
  // columns are never read (not zeroing ~50 MB of packed rows saves ~60 ms per layer at a
  // 4,096-token prefill).
  std::vector<int64_t> chunk0(num_experts + 1, 0);
  for (int64_t e = 0; e < num_experts; ++e)
    chunk0[e + 1] = chunk0[e] + (rt.counts[e] + kTile - 1) / kTile;
  const auto opts = torch::TensorOptions().dtype(at::kBFloat16);
  auto packed_x = torch::empty({chunk0[num_experts], hidden_size * kTile}, opts);
  auto packed_act = torch::empty({chunk0[num_experts], inter * kTile}, opts);
  bf16* px = packed_x.data_ptr<bf16>();
  bf16* pa = packed_act.data_ptr<bf16>();
  const int64_t x_chunk = hidden_size * kTile, act_chunk = inter * kTile;

  at::parallel_for(0, static_cast<int64_t>(rt.order.size()), 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e =
          std::upper_bound(rt.starts.begin(), rt.starts.end(), i) - rt.starts.begin() - 1;
      const int64_t r = i - rt.starts[e];
      pack_row(xp + rt.order[i] * hidden_size, hidden_size,
               px + (chunk0[e] + r / kTile) * x_chunk, r % kTile);
    }
  });

  const auto up_tasks = make_tasks(rt.counts, inter);
  at::parallel_for(0, static_cast<int64_t>(up_tasks.size()), 1, [&](int64_t begin, int64_t end) {
    TileScope tiles;
    alignas(64) float gate_tile[kColsPerTask * kTile], up_tile[kColsPerTask * kTile];
    float gate[kColsPerTask], up[kColsPerTask];
    bf16 act[kColsPerTask];
    for (int64_t t = begin; t < end; ++t) {
      const auto [e, col] = up_tasks[t];
      const bf16* we = w13p + e * 2 * inter * hidden_size;
      for (int64_t c = 0; c * kTile < rt.counts[e]; ++c) {
        const bf16* chunk = px + (chunk0[e] + c) * x_chunk;
        amx_rows32(we + col * hidden_size, hidden_size, chunk, hidden_size, gate_tile);
        amx_rows32(we + (inter + col) * hidden_size, hidden_size, chunk, hidden_size, up_tile);
        bf16* act_chunk_p = pa + (chunk0[e] + c) * act_chunk;
        for (int64_t m = 0; m < std::min(kTile, rt.counts[e] - c * kTile); ++m) {
          tile_column(gate_tile, m, gate);
          tile_column(up_tile, m, up);
          gate_row(gate, up, kColsPerTask, act);
          // Written straight into the down projection's B layout (K = I).
          for (int64_t n = 0; n < kColsPerTask; n += 2)
            std::memcpy(act_chunk_p + packed_at(m, col + n), act + n, 2 * sizeof(bf16));
        }
      }
    }
  });

  const auto down_tasks = make_tasks(rt.counts, hidden_size);
  at::parallel_for(0, static_cast<int64_t>(down_tasks.size()), 1, [&](int64_t begin, int64_t end) {
    TileScope tiles;
    alignas(64) float tile[kColsPerTask * kTile];
    float row[kColsPerTask];
    for (int64_t t = begin; t < end; ++t) {
      const auto [e, col] = down_tasks[t];
      for (int64_t c = 0; c * kTile < rt.counts[e]; ++c) {
        amx_rows32(w2p + (e * hidden_size + col) * inter, inter, pa + (chunk0[e] + c) * act_chunk,
                   inter, tile);
        for (int64_t m = 0; m < std::min(kTile, rt.counts[e] - c * kTile); ++m) {
          tile_column(tile, m, row);
          const int64_t out_row = rt.order[rt.starts[e] + c * kTile + m];
          row_from_float(row, outp + out_row * hidden_size + col, kColsPerTask);
        }
      }
    }
  });
}

// Whole tile rows (K) and whole tasks (output columns) in both projections.
bool use_amx(int64_t hidden_size, int64_t inter) {
  return hidden_size % kTileCols == 0 && inter % kTileCols == 0 && amx_ready();
}
#else
bool use_amx(int64_t, int64_t) { return false; }
void experts_amx(const bf16*, const Routing&, const bf16*, const bf16*, int64_t, int64_t, bf16*) {}
#endif

}  // namespace

// Which path fused_experts takes for these sizes: "amx", "avx512_bf16" (dot products), or
// "none" when this CPU has neither (the caller keeps its torch path).
std::string fused_experts_backend(int64_t hidden_size, int64_t inter) {
  if (!kHasFusedExperts) return "none";
  return use_amx(hidden_size, inter) ? "amx" : "avx512_bf16";
}

torch::Tensor fused_experts(torch::Tensor hidden, torch::Tensor expert_ids, torch::Tensor w13,
                            torch::Tensor w2) {
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && w13.scalar_type() == at::kBFloat16 &&
                  w2.scalar_type() == at::kBFloat16,
              "fused_experts: hidden, w13 and w2 must be bf16");
  TORCH_CHECK(hidden.dim() == 2 && w13.dim() == 3 && w2.dim() == 3,
              "fused_experts: hidden [N, H], w13 [E, 2I, H], w2 [E, H, I] expected");
  TORCH_CHECK(hidden.is_contiguous() && w13.is_contiguous() && w2.is_contiguous(),
              "fused_experts: hidden, w13 and w2 must be contiguous");
  const int64_t num_rows = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t num_experts = w13.size(0), inter = w13.size(1) / 2;
  TORCH_CHECK(w13.size(2) == hidden_size && w13.size(1) == 2 * inter &&
                  w2.size(0) == num_experts && w2.size(1) == hidden_size && w2.size(2) == inter,
              "fused_experts: weight shapes do not match hidden");
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong && expert_ids.dim() == 1 &&
                  expert_ids.size(0) == num_rows,
              "fused_experts: expert_ids must be int64 [N]");

  const Routing routing = sort_rows(expert_ids, num_experts);
  // Every row is written: by its expert, or zeroed here when skipped (-1).
  auto out = torch::empty_like(hidden);
  for (const int64_t r : routing.skipped)
    std::memset(static_cast<void*>(out.data_ptr<bf16>() + r * hidden_size), 0,
                hidden_size * sizeof(bf16));
  const bf16* xp = hidden.data_ptr<bf16>();
  const bf16* w13p = w13.data_ptr<bf16>();
  const bf16* w2p = w2.data_ptr<bf16>();
  if (use_amx(hidden_size, inter)) {
    experts_amx(xp, routing, w13p, w2p, hidden_size, inter, out.data_ptr<bf16>());
  } else {
    auto act = torch::empty({routing.starts[num_experts], inter}, hidden.options());
    experts_dot(xp, routing, w13p, w2p, hidden_size, inter, act.data_ptr<bf16>(),
                out.data_ptr<bf16>());
  }
  return out;
}
