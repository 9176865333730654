// Fused elementwise ops of a decoder layer, one pass over each row in fp32:
//   silu_and_mul(x [T, 2I]) -> silu(x[:, :I]) * x[:, I:]            (SwiGLU gate)
//   rms_norm(x [T, H], w [H], eps) -> w * (x / sqrt(mean(x^2) + eps)) (Hugging Face's rounding:
//       the normalised row is rounded to x's dtype before the weight multiplies it)
//   fused_add_rms_norm(x, residual, w, eps) -> (rms_norm(x + residual), x + residual)
//       (the pre-norm residual stream: the sum is rounded to x's dtype, as torch's add stores it)
//   rotary_embedding(positions, x [T, H, R], cos, sin, interleaved) -> x rotated per position
//       (neox halves; interleaved pairs come out de-interleaved, as the reference returns them)
//   moe_combine(y [T * k, H], weights [T, k] fp32) -> [T, H]: sum_j weights[t, j] * y[t * k + j],
//       summed in fp32 in slot order and rounded once (the local MoE dispatcher's combine)
// Each replaces 2-12 torch ops (and their temporaries) with one read and one write of the row,
// and rounds where the torch reference rounds (every op's result stored in x's dtype), so bf16
// results match the reference's up to the last bit of an exp or a sum.
#include "vec.h"

#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

namespace {

using namespace widellm_cpu;

// Rows per parallel task: enough elements that a task outweighs the cost of handing it out.
constexpr int64_t kElemsPerTask = 16384;

inline int64_t rows_per_task(int64_t width) {
  return std::max<int64_t>(1, kElemsPerTask / std::max<int64_t>(width, 1));
}

template <typename T>
void silu_and_mul_kernel(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), inter = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, rows_per_task(2 * inter), [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      for (int64_t r = begin; r < end; ++r)
        silu_mul_row_bf16(xp + r * xs, xp + r * xs + inter, op + r * os, inter);
      return;
    }
    std::vector<float> g(inter), u(inter);
    for (int64_t r = begin; r < end; ++r) {
      row_to_float(xp + r * xs, g.data(), inter);
      row_to_float(xp + r * xs + inter, u.data(), inter);
      silu_mul_inplace<T>(g.data(), u.data(), inter);
      row_from_float(g.data(), op + r * os, inter);
    }
  });
}

inline float sum_squares(const float* x, int64_t n) {
  float s = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  s = _mm512_reduce_add_ps(acc);
#elif defined(WIDELLM_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  s = reduce_add8(acc);
#endif
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// One row of RMSNorm, h [hidden] fp32 -> out: normalised, rounded to T (as the reference
// rounds before the weight), times the weight, rounded again.
template <typename T>
inline void rms_norm_row(float* h, const float* wf, int64_t hidden, float eps, T* rounded,
                         T* out) {
  const float inv = 1.f / std::sqrt(sum_squares(h, hidden) / hidden + eps);
  for (int64_t i = 0; i < hidden; ++i) h[i] *= inv;
  row_from_float(h, rounded, hidden);
  row_to_float(rounded, h, hidden);
  for (int64_t i = 0; i < hidden; ++i) h[i] *= wf[i];
  row_from_float(h, out, hidden);
}

#if defined(__AVX512F__)
// rms_norm_row's result (and the residual add of rms_norm_kernel) for a bf16 row whose width is
// a multiple of 16, in two passes over registers instead of ten over fp32 copies: the same
// roundings and the same order of the sum of squares, so the same bits. h: [hidden] scratch.
inline void rms_norm_row_bf16(const at::BFloat16* x, const at::BFloat16* res, const float* wf,
                              int64_t hidden, float eps, float* h, at::BFloat16* res_out,
                              at::BFloat16* out) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 16) {
    __m512 v = load_bf16(x + i);
    if (res != nullptr) {
      v = round_to_bf16(_mm512_add_ps(v, load_bf16(res + i)));
      store_bf16(res_out + i, v);
    }
    _mm512_storeu_ps(h + i, v);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / hidden + eps));
  for (int64_t i = 0; i < hidden; i += 16) {
    const __m512 normed = round_to_bf16(_mm512_mul_ps(_mm512_loadu_ps(h + i), inv));
    store_bf16(out + i, _mm512_mul_ps(normed, _mm512_loadu_ps(wf + i)));
  }
}
#endif

// out <- rms_norm(x) or, with a residual, res_out <- T(x + residual) and out <- rms_norm(res_out):
// the residual add and the norm in one pass over the row.
template <typename T>
void rms_norm_kernel(const torch::Tensor& x, const torch::Tensor* residual, const torch::Tensor& w,
                     double eps, torch::Tensor& out, torch::Tensor* res_out) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  T* rop = res_out ? res_out->data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), os = out.stride(0);
  const int64_t rs = residual ? residual->stride(0) : 0, ros = res_out ? res_out->stride(0) : 0;
  std::vector<float> wf(hidden);
  row_to_float(w.data_ptr<T>(), wf.data(), hidden);
  at::parallel_for(0, rows, rows_per_task(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden), r(hidden);
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (hidden % 16 == 0) {
        for (int64_t row = begin; row < end; ++row)
          rms_norm_row_bf16(xp + row * xs, rp ? rp + row * rs : nullptr, wf.data(), hidden,
                            static_cast<float>(eps), h.data(), rop ? rop + row * ros : nullptr,
                            op + row * os);
        return;
      }
    }
#endif
    std::vector<T> rounded(hidden);
    for (int64_t row = begin; row < end; ++row) {
      row_to_float(xp + row * xs, h.data(), hidden);
      if (rp != nullptr) {
        row_to_float(rp + row * rs, r.data(), hidden);
        for (int64_t i = 0; i < hidden; ++i) h[i] += r[i];
        row_from_float(h.data(), rop + row * ros, hidden);
        round_row<T>(h.data(), h.data(), hidden);
      }
      rms_norm_row(h.data(), wf.data(), hidden, static_cast<float>(eps), rounded.data(),
                   op + row * os);
    }
  });
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": expected a 2-D tensor with contiguous rows");
}

template <typename T>
void moe_combine_kernel(const torch::Tensor& y, const torch::Tensor& weights, torch::Tensor& out) {
  const int64_t tokens = out.size(0), hidden = out.size(1), top_k = weights.size(1);
  const T* yp = y.data_ptr<T>();
  const float* wp = weights.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, rows_per_task(hidden * top_k), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(hidden), row(hidden);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < top_k; ++j) {
        row_to_float(yp + (t * top_k + j) * hidden, row.data(), hidden);
        const float w = wp[t * top_k + j];
        for (int64_t i = 0; i < hidden; ++i) acc[i] += row[i] * w;
      }
      row_from_float(acc.data(), op + t * hidden, hidden);
    }
  });
}

}  // namespace

torch::Tensor moe_combine(torch::Tensor y, torch::Tensor weights) {
  TORCH_CHECK(y.device().is_cpu(), "moe_combine: CPU tensors only");
  TORCH_CHECK(y.dim() == 2 && weights.dim() == 2 && y.is_contiguous() && weights.is_contiguous(),
              "moe_combine: contiguous y [T * k, H] and weights [T, k] expected");
  TORCH_CHECK(weights.scalar_type() == at::kFloat, "moe_combine: weights must be fp32");
  TORCH_CHECK(y.size(0) == weights.size(0) * weights.size(1),
              "moe_combine: y has ", y.size(0), " rows, weights ", weights.size(0), " x ",
              weights.size(1));
  auto out = torch::empty({weights.size(0), y.size(1)}, y.options());
  dispatch_float_types(y.scalar_type(), "moe_combine",
                       [&](auto t) { moe_combine_kernel<decltype(t)>(y, weights, out); });
  return out;
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: odd last dimension");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  dispatch_float_types(x.scalar_type(), "silu_and_mul",
                       [&](auto t) { silu_and_mul_kernel<decltype(t)>(x, out); });
  return out;
}

namespace {

// Checks, then rms_norm_kernel for x's dtype; residual/res_out as there (both null or both set).
void rms_norm_dispatch(const char* name, const torch::Tensor& x, const torch::Tensor* residual,
                       const torch::Tensor& weight, double eps, torch::Tensor& out,
                       torch::Tensor* res_out) {
  check_rows(x, name);
  if (residual != nullptr) {
    check_rows(*residual, name);
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                name, ": residual must match x in shape and dtype");
  }
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              name, ": weight must be contiguous [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), name, ": weight dtype differs from x");
  dispatch_float_types(x.scalar_type(), name, [&](auto t) {
    rms_norm_kernel<decltype(t)>(x, residual, weight, eps, out, res_out);
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  rms_norm_dispatch("rms_norm", x, nullptr, weight, eps, out, nullptr);
  return out;
}

std::vector<torch::Tensor> fused_add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                              torch::Tensor weight, double eps) {
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  auto res_out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  rms_norm_dispatch("fused_add_rms_norm", x, &residual, weight, eps, out, &res_out);
  return {out, res_out};
}

namespace {

// One head's rotation, in place on buf [R] fp32 (neox halves): with cr/sr the cos/sin rounded
// to T, buf[i] <- T(x_i * cr_i) + T(-x_j * sr_i) and buf[j] <- T(x_j * cr_j) + T(x_i * sr_j),
// j = half + i, each product stored as T as the reference stores it (the sum is rounded when
// the row is written out).
template <typename T>
inline void rotate_half(float* buf, const float* cr, const float* sr, int64_t half) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, float>) {
    auto rnd = [](__m512 v) {
      if constexpr (std::is_same_v<T, at::BFloat16>) return round_to_bf16(v);
      else return v;
    };
    for (; i + 16 <= half; i += 16) {
      const int64_t j = half + i;
      const __m512 x1 = _mm512_loadu_ps(buf + i), x2 = _mm512_loadu_ps(buf + j);
      const __m512 lo = _mm512_add_ps(
          rnd(_mm512_mul_ps(x1, _mm512_loadu_ps(cr + i))),
          rnd(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), _mm512_loadu_ps(sr + i))));
      const __m512 hi = _mm512_add_ps(rnd(_mm512_mul_ps(x2, _mm512_loadu_ps(cr + j))),
                                      rnd(_mm512_mul_ps(x1, _mm512_loadu_ps(sr + j))));
      _mm512_storeu_ps(buf + i, lo);
      _mm512_storeu_ps(buf + j, hi);
    }
  }
#endif
  for (; i < half; ++i) {
    const int64_t j = half + i;
    const float x1 = buf[i], x2 = buf[j];
    buf[i] = round_to<T>(x1 * cr[i]) + round_to<T>(-x2 * sr[i]);
    buf[j] = round_to<T>(x2 * cr[j]) + round_to<T>(x1 * sr[j]);
  }
}

#if defined(__AVX512F__)
// rotate_half of one bf16 head row (neox halves, half a multiple of 16) from src straight to
// dst: the same products, roundings and sums, without the fp32 copy of the row.
inline void rotate_half_row_bf16(const at::BFloat16* src, const float* cr, const float* sr,
                                 int64_t half, at::BFloat16* dst) {
  for (int64_t i = 0; i < half; i += 16) {
    const int64_t j = half + i;
    const __m512 x1 = load_bf16(src + i), x2 = load_bf16(src + j);
    store_bf16(dst + i, _mm512_add_ps(
        round_to_bf16(_mm512_mul_ps(x1, _mm512_loadu_ps(cr + i))),
        round_to_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2),
                                    _mm512_loadu_ps(sr + i)))));
    store_bf16(dst + j, _mm512_add_ps(round_to_bf16(_mm512_mul_ps(x2, _mm512_loadu_ps(cr + j))),
                                      round_to_bf16(_mm512_mul_ps(x1, _mm512_loadu_ps(sr + j)))));
  }
}
#endif

template <typename T>
void rotary_kernel(const torch::Tensor& positions, const torch::Tensor& x,
                   const torch::Tensor& cos, const torch::Tensor& sin, bool interleaved,
                   torch::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), R = x.size(2), half = R / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  at::parallel_for(0, tokens, rows_per_task(heads * R), [&](int64_t begin, int64_t end) {
    std::vector<float> raw(R), buf(R), cr(R), sr(R);
    for (int64_t t = begin; t < end; ++t) {
      // The reference casts cos/sin to T before multiplying: round once per token.
      round_row<T>(cp + pos[t] * R, cr.data(), R);
      round_row<T>(sp + pos[t] * R, sr.data(), R);
      for (int64_t h = 0; h < heads; ++h) {
        const T* row = xp + t * xs0 + h * xs1;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          if (!interleaved && half % 16 == 0) {
            rotate_half_row_bf16(row, cr.data(), sr.data(), half, op + (t * heads + h) * R);
            continue;
          }
        }
#endif
        if (interleaved) {  // pairs (2i, 2i+1) become (i, half + i), as the reference does
          row_to_float(row, raw.data(), R);
          for (int64_t i = 0; i < half; ++i) {
            buf[i] = raw[2 * i];
            buf[half + i] = raw[2 * i + 1];
          }
        } else {
          row_to_float(row, buf.data(), R);
        }
        rotate_half<T>(buf.data(), cr.data(), sr.data(), half);
        row_from_float(buf.data(), op + (t * heads + h) * R, R);
      }
    }
  });
}

}  // namespace

// x [T, H, R] (last dim contiguous), positions [T] int64, cos/sin [max_pos, R] fp32 (the
// frequencies repeated for both halves) -> rotated [T, H, R] contiguous, in x's dtype.
torch::Tensor rotary_embedding(torch::Tensor positions, torch::Tensor x, torch::Tensor cos,
                               torch::Tensor sin, bool interleaved) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1,
              "rotary_embedding: expected a CPU [T, H, R] tensor with contiguous rows");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary_embedding: odd rotary dimension");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
              positions.size(0) == x.size(0), "rotary_embedding: positions must be [T] int64");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
              cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == x.size(2) &&
              sin.size(1) == x.size(2), "rotary_embedding: cos/sin must be contiguous fp32 [P, R]");
  auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  dispatch_float_types(x.scalar_type(), "rotary_embedding", [&](auto t) {
    rotary_kernel<decltype(t)>(positions, x, cos, sin, interleaved, out);
  });
  return out;
}
