// The Python module of widellm's CPU kernels (built by widellm/ops/cpu_kernels.py).
// Only this file includes torch/extension.h (pybind11 and all of libtorch's C++ API): it
// alone took ~57 s of the ~60 s that each kernel file took to compile on a 2-core AVX2 VM, so
// the kernels include the lighter torch/types.h (~19 s).
#include <torch/extension.h>

#include "ops.h"

// The compute kernels run without the GIL (they touch no Python object): with async
// scheduling the scheduler thread and the ZMQ I/O threads then run alongside a step instead of
// waiting out a whole forward (a fused decode stack is one call of tens of milliseconds).
using ReleaseGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention reading K/V in place (CPU); bf16_dot=False keeps bf16 on the "
        "vector path (tests and benchmarks compare the two)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("bf16_dot") = true, ReleaseGil());
  m.def("paged_decode_attention_backend", &paged_decode_attention_backend,
        "Path of paged_decode_attention in bf16 for (block_size, group, head_size, v_head_size): "
        "amx or vector");
  m.def("silu_and_mul", &silu_and_mul, ReleaseGil(), "silu(x[:, :I]) * x[:, I:] (CPU)");
  m.def("rms_norm", &rms_norm, ReleaseGil(), "RMSNorm with Hugging Face's rounding (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, ReleaseGil(),
        "(rms_norm(x + residual), x + residual) in one pass (CPU)");
  m.def("rotary_embedding", &rotary_embedding, ReleaseGil(),
        "Rotary embedding of one [T, H, R] tensor (CPU)");
  m.def("mla_decode_supported", &mla_decode_supported,
        "Whether mla_decode_attention runs for (block_size, head_size, v_head_size) here");
  m.def("mla_decode_attention", &mla_decode_attention, ReleaseGil(),
        "MLA decode attention over the paged latent cache, bf16 (CPU, AMX)");
  m.def("prefill_attention_backend", &prefill_attention_backend,
        "Path of prefill_attention for (head_size, v_head_size, dtype): amx or avx512_bf16 "
        "(bf16), avx2 (fp32), or none",
        py::arg("head_size"), py::arg("v_head_size"), py::arg("dtype") = at::kBFloat16);
  m.def("prefill_attention_supported", &prefill_attention_supported,
        "Whether prefill_attention runs for (head_size, v_head_size, dtype) here",
        py::arg("head_size"), py::arg("v_head_size"), py::arg("dtype") = at::kBFloat16);
  m.def("prefill_attention", &prefill_attention,
        "Causal attention of one prompt chunk into out, bf16 (AMX or AVX512-BF16) or fp32 "
        "(AVX2); allow_amx=False takes bf16's vector path (tests compare the two)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("scale"),
        py::arg("allow_amx") = true, ReleaseGil());
  m.def("prefill_attention_batch", &prefill_attention_batch,
        "Causal attention of a step's prompt chunks into out in one call, bf16 (AMX or "
        "AVX512-BF16) or fp32 (AVX2); allow_amx=False takes bf16's vector path",
        py::arg("q"), py::arg("out"), py::arg("k"), py::arg("v"), py::arg("query_start_loc"),
        py::arg("scale"), py::arg("allow_amx") = true, ReleaseGil());
  m.def("moe_combine", &moe_combine, ReleaseGil(),
        "sum_j weights[t, j] * y[t * k + j] in fp32, rounded once (CPU)");
  m.def("store_kv_cache", &store_kv_cache, ReleaseGil(),
        "rows[slot_mapping[t]] <- src[t]: a step's keys or values into the paged cache (CPU)");
  m.def("fused_experts_backend", &fused_experts_backend,
        "Path of fused_experts for (hidden_size, intermediate_size): amx, avx512_bf16 or none");
  m.def("fused_experts", &fused_experts, ReleaseGil(),
        "Routed-expert MLPs of decode-sized batches, bf16 (CPU, AVX512-BF16)");
  m.def("llama_decode_layers", &llama_decode_layers, ReleaseGil(),
        "Llama-family decoder layers over a decode-only batch in one call (CPU, packed "
        "linears); returns (output, residual)");
}
