// The causal prefill kernel in two halves: the driver (prefill_attention.cpp: the contract,
// argument checks, and the packing and attention tasks spread over the threads) and one path
// per dtype, which packs a KV head's keys and values and attends a block of queries:
//   bf16 (prefill_attention_bf16.cpp): AMX tiles, or AVX512-BF16 dot products;
//   fp32 (prefill_attention_fp32.cpp): AVX2 + FMA in 8 lanes, for the CPUs where widellm
//     serves in fp32 (no native bf16 matmuls).
// Both are a PrefillPath<T>, whose members the driver's template calls:
//   key_elems(L, Dk), value_elems(L, Dv): elements of one KV head's packed keys and values;
//   pack(k, v, l0, l1, L, Dk, Dv, k_packed, v_packed): positions [l0, l1) of one KV head
//     (l0 a multiple of kPackChunk) into the packed forms; the call that reaches L also
//     writes the padding past it;
//   a worker (one per thread, constructed on it: it owns scratch, and AMX tile state) with
//   attend(q, i0, n, p0, k_packed, v_packed, Dk, Dv, scale, out, out_row): queries
//     [i0, i0 + n) (n <= kBlock) of one query head, the first at context position p0, so
//     query r sees positions [0, p0 + r]; q and out point at that head's row 0.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <type_traits>

namespace widellm_cpu::prefill {

constexpr int64_t kBlock = 16;       // queries of one block, the unit of an attention task
constexpr int64_t kPackChunk = 256;  // positions of one packing task

// One head's rows: component d of token t is data[t * row + d].
template <typename T>
struct RowView {
  const T* data;
  int64_t row;
};

template <int kR>
using Rows = std::integral_constant<int, kR>;

// The row groups of a block of n queries, as the vector paths accumulate them: f(Rows<kGroup>(),
// r) for r = 0, kGroup, ..., then f(Rows<n % kGroup>(), r) for the rows left (each count its
// own instantiation of f's body).
template <int kGroup, typename F>
void for_row_groups(int64_t n, F&& f) {
  static_assert(kGroup >= 1 && kGroup <= 6, "the switch below covers the counts below 6");
  int64_t r = 0;
  for (; r + kGroup <= n; r += kGroup) f(Rows<kGroup>(), r);
  switch (n - r) {
    case 5: if constexpr (kGroup > 5) f(Rows<5>(), r); break;
    case 4: if constexpr (kGroup > 4) f(Rows<4>(), r); break;
    case 3: if constexpr (kGroup > 3) f(Rows<3>(), r); break;
    case 2: if constexpr (kGroup > 2) f(Rows<2>(), r); break;
    case 1: if constexpr (kGroup > 1) f(Rows<1>(), r); break;
    default: break;
  }
}

// One path per element type: prefill_attention_bf16.cpp specializes these members for
// at::BFloat16 (built where the CPU has AVX512-BF16), prefill_attention_fp32.cpp for float
// (where it has AVX2 + FMA); the template itself has no definitions.
template <typename T>
class PrefillPath {
 public:
  static int64_t key_elems(int64_t L, int64_t Dk);
  static int64_t value_elems(int64_t L, int64_t Dv);
  static void pack(RowView<T> k, RowView<T> v, int64_t l0, int64_t l1, int64_t L, int64_t Dk,
                   int64_t Dv, T* k_packed, T* v_packed);

  // amx: bf16 blocks in AMX tiles (configured for this thread while the worker lives) rather
  // than AVX512-BF16 dot products; fp32 has one path and ignores it.
  explicit PrefillPath(bool amx);
  ~PrefillPath();
  PrefillPath(const PrefillPath&) = delete;
  PrefillPath& operator=(const PrefillPath&) = delete;
  void attend(RowView<T> q, int64_t i0, int64_t n, int64_t p0, const T* k_packed,
              const T* v_packed, int64_t Dk, int64_t Dv, float scale, T* out, int64_t out_row);

 private:
  struct Worker;
  std::unique_ptr<Worker> worker_;
};

}  // namespace widellm_cpu::prefill
