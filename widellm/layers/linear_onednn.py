"""The oneDNN-packed linear method: bf16 or fp32 CPU weights prepacked once for oneDNN.

``F.linear`` on bf16 CPU tensors calls oneDNN with a plain row-major weight, which oneDNN
reorders into its blocked layout on every call. This method does that reorder once, after
loading (``torch.ops.mkldnn._reorder_linear_weight``), and every forward then runs
``torch.ops.mkldnn._linear_pointwise`` on the packed weight. Measured on a 2-core
AVX-512-BF16/AMX CPU for the SmolLM2-135M and deepseek-v3-small projections: 1.1-1.9x faster
at 1-64 rows, mostly 1.1-1.5x at 256, on par (within noise) at 1,024-4,096, with results equal
to ``F.linear``'s up to bf16 rounding (tests/layers/test_linear_packed.py compares them), so
there is one path for every batch size.

fp32 weights are packed too: ``F.linear`` in fp32 is MKL's sgemm, which on a 2-core AVX2 CPU
(AMD EPYC, no AVX-512) ran SmolLM2's decoder projections 1.3-1.9x slower than oneDNN's packed
fp32 kernel at 16-64 rows, 1.1-1.5x at 256-2,048, and its LM head 2.5x slower at 16 rows. On
CPUs whose oneDNN has no bf16 kernels (AVX2 ones) only fp32 weights are packed.

After packing, the layer's ``weight`` parameter is gone (the plain weight is freed: no doubled
memory) and its ``packed_weight`` buffer holds the opaque layout, so code that reads ``weight``
afterwards fails loudly. ``WIDELLM_CPU_PACKED_LINEAR=0`` turns the method off (every layer stays
plain, the reference).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from widellm.layers.linear_method import LinearMethod

PACKED_LINEAR_ENV = "WIDELLM_CPU_PACKED_LINEAR"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# The batch size oneDNN tunes the packed layout for (every batch size then runs on that one
# packed weight). Measured on AMX, hints from 1 to 4,096 (or none) made no consistent difference
# at any batch size.
PACK_BATCH_SIZE_HINT = 64
# _linear_pointwise's fused post-op: none (a plain x W^T + b).
_NO_POSTOP = "none"
PACKABLE_DTYPES = (torch.bfloat16, torch.float32)


def packed_linear_enabled() -> bool:
    """``$WIDELLM_CPU_PACKED_LINEAR`` (default on); raises ValueError on anything but a boolean."""
    value = os.environ.get(PACKED_LINEAR_ENV, "1").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{PACKED_LINEAR_ENV}={value!r}: expected one of {_TRUE + _FALSE}")


def packed_linear_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """This torch has oneDNN with the packed-linear ops and, for bf16, the CPU runs oneDNN's
    bf16 kernels (fp32 runs wherever oneDNN does)."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not all(hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return True
    bf16_check = getattr(ops, "_is_mkldnn_bf16_supported", None)
    return bf16_check is None or bool(bf16_check())


def can_pack(weight: torch.Tensor) -> bool:
    """A non-empty 2-D bf16 or fp32 CPU weight (what the packed path computes in)."""
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES
            and weight.dim() == 2 and weight.numel() > 0)


class OneDNNPackedLinearMethod(LinearMethod):
    """The weight lives only as ``layer.packed_weight``: oneDNN's blocked layout (bf16 or fp32,
    as loaded), an opaque tensor of logical shape ``[out_features, in_features]``.

    apply: x ``[..., in_features]`` in the weight's dtype (any strides) -> ``[...,
    out_features]`` in that dtype.
    """

    name = "onednn_packed"

    def process_weights_after_loading(self, layer: nn.Linear) -> None:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(),
                                                          PACK_BATCH_SIZE_HINT)
        del layer.weight
        # Not persistent: the opaque layout is no checkpoint format.
        layer.register_buffer("packed_weight", packed, persistent=False)

    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias,
                                                   _NO_POSTOP, [], "")

    def dense_weight(self, layer: nn.Linear) -> torch.Tensor:
        if "weight" not in layer._parameters:
            raise RuntimeError("a packed linear's plain weight is gone (read it before packing)")
        return super().dense_weight(layer)
