// Helpers of the one-call decode path (decoder_layers.cpp) and the KV store (kv_store.cpp).
#pragma once

#include <torch/types.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstring>
#include <string>

namespace decode_layers {

using OptTensor = c10::optional<torch::Tensor>;

// oneDNN's packed-weight linear, the op PackedLinear.forward calls.
inline c10::OperatorHandle packed_linear_op() {
  return c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
}

// x [T, K] @ packed W^T (+ b), with PackedLinear.forward's arguments.
inline torch::Tensor packed_linear(const c10::OperatorHandle& op, const torch::Tensor& x,
                                   const torch::Tensor& w, const OptTensor& b) {
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(b);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<c10::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// rows [num_slots, ...] <- src [T, ...] at slots [T], writing src's per-token values (contiguous
// within a token, any token stride) from column offset `col` of each cache row, for tokens
// [t0, t1) (all of them by default). Slots are checked by check_slots.
inline void store_rows(const torch::Tensor& src, torch::Tensor& rows, const int64_t* slots,
                       int64_t col = 0, int64_t t0 = 0, int64_t t1 = -1) {
  const int64_t T = src.size(0);
  const int64_t bytes = src.numel() / std::max<int64_t>(T, 1) * src.element_size();
  const char* sp = static_cast<const char*>(src.data_ptr());
  char* cp = static_cast<char*>(rows.data_ptr()) + col * rows.element_size();
  const int64_t s_stride = src.stride(0) * src.element_size();
  const int64_t c_stride = rows.stride(0) * rows.element_size();
  for (int64_t t = t0, end = t1 < 0 ? T : t1; t < end; ++t)
    std::memcpy(cp + slots[t] * c_stride, sp + t * s_stride, bytes);
}

inline void check_slots(const torch::Tensor& slot_mapping, int64_t T, int64_t num_slots,
                        const char* name) {
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == T, name, ": slot_mapping must be [T] int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_VALUE(slots[t] >= 0 && slots[t] < num_slots, name, ": slot_mapping[", t,
                      "] out of range");
}

}  // namespace decode_layers
