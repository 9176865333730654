"""Linear layers: a CPU fast path with bf16 or fp32 weights prepacked for oneDNN.

``F.linear`` on bf16 CPU tensors calls oneDNN with a plain row-major weight, which oneDNN
reorders into its blocked layout on every call. :func:`pack_linear_weights` does that reorder
once, after loading (``torch.ops.mkldnn._reorder_linear_weight``), and every packed module then
runs ``torch.ops.mkldnn._linear_pointwise`` on the packed weight. Measured on a 2-core
AVX-512-BF16/AMX CPU for the SmolLM2-135M and deepseek-v3-small projections: 1.1-1.9x faster
at 1-64 rows, mostly 1.1-1.5x at 256, on par (within noise) at 1,024-4,096, with results equal
to ``F.linear``'s up to bf16 rounding (tests/layers/test_linear_packed.py compares them), so
there is one path for every batch size.

fp32 weights are packed too: ``F.linear`` in fp32 is MKL's sgemm, which on a 2-core AVX2 CPU
(AMD EPYC, no AVX-512) ran SmolLM2's decoder projections 1.3-1.9x slower than oneDNN's packed
fp32 kernel at 16-64 rows, 1.1-1.5x at 256-2,048, and its LM head 2.5x slower at 16 rows. On
CPUs whose oneDNN has no bf16 kernels (AVX2 ones) only fp32 weights are packed.

Packing is done in place: the module's class becomes :class:`PackedLinear` and its ``weight``
parameter is replaced by the opaque ``packed_weight`` buffer, so the plain weight is freed (no
doubled memory) and every holder of the module (e.g. MLA's handle on ``kv_b_proj``) gets the
fast path. A ``Linear`` whose weight storage is held by anything else in the model (the
``lm_head`` tied to the embedding, a tensor split out of it by a load-time hook) is left plain,
except the LM head, which gets a packed copy of its own (see :func:`pack_linear_weights`).

The reference path is ``nn.Linear`` itself: ``WIDELLM_CPU_PACKED_LINEAR=0`` leaves every module
unpacked.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import nn

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


class PackedLinear(nn.Linear):
    """``nn.Linear`` whose weight exists only as ``packed_weight``: oneDNN's blocked layout (bf16
    or fp32, as the weight was), an opaque tensor of logical shape ``[out_features,
    in_features]``. ``weight`` is gone, so
    code that reads it after packing fails loudly. Made by :func:`pack_linear` from a loaded
    ``nn.Linear``; not constructed directly.

    forward: x ``[..., in_features]`` in the weight's dtype (any strides) -> ``[...,
    out_features]`` in that dtype.
    """

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, _NO_POSTOP, [], ""
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + ", packed=onednn"


def pack_linear(module: nn.Linear) -> None:
    """Turn a loaded ``nn.Linear`` into a :class:`PackedLinear`, in place; its plain weight is
    released (freed unless something else still holds the tensor)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_BATCH_SIZE_HINT)
    del module.weight
    module.__class__ = PackedLinear
    # Not persistent: the opaque layout is no checkpoint format.
    module.register_buffer("packed_weight", packed, persistent=False)


def _storage_refs(model: nn.Module) -> dict[int, int]:
    """How many tensors of ``model`` (parameters and buffers counted once per holder, plus
    plain tensor attributes such as MLA's split ``w_uk``) hold each storage."""
    refs: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        if t.layout == torch.strided and t.device.type == "cpu":
            key = t.untyped_storage().data_ptr()
            refs[key] = refs.get(key, 0) + 1

    for module in model.modules():
        for t in module._parameters.values():
            if t is not None:
                add(t)
        for t in module._buffers.values():
            if t is not None:
                add(t)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                add(value)
    return refs


def pack_linear_weights(model: nn.Module, enabled: bool | None = None) -> int:
    """Pack every plain ``nn.Linear`` of ``model`` whose weight is bf16 or fp32 on CPU, of a
    dtype oneDNN computes here (:func:`packed_linear_available`), and not shared.

    Run it after the weights are loaded and every ``process_weights_after_loading`` hook has
    run: nothing may read a packed module's ``weight`` afterwards (calling the module is fine).
    Subclasses of ``nn.Linear`` are left alone (their forward may do more than ``x W^T + b``),
    and so is any ``Linear`` whose weight storage another tensor of the model also holds.

    Args:
        model: the loaded model, in eval use (the packed op has no backward).
        enabled: None reads :data:`PACKED_LINEAR_ENV`.

    Returns:
        How many modules were packed (0 when disabled or oneDNN cannot run the dtypes here).
    """
    if enabled is None:
        enabled = packed_linear_enabled()
    if not enabled:
        return 0
    available = {dtype: packed_linear_available(dtype) for dtype in PACKABLE_DTYPES}

    def packable(m: nn.Module) -> bool:
        return type(m) is nn.Linear and can_pack(m.weight) and available[m.weight.dtype]

    refs = _storage_refs(model)
    targets = [
        m for m in model.modules()
        if packable(m) and refs[m.weight.untyped_storage().data_ptr()] == 1
    ]
    # The LM head is the largest matmul of a small model's decode step: when it is tied to the
    # embedding it gets its own packed copy (the embedding keeps the plain weight).
    lm_head = getattr(model, "lm_head", None)
    if packable(lm_head) and lm_head not in targets:
        targets.append(lm_head)
    for m in targets:
        pack_linear(m)
    return len(targets)


def warm_packed_linears(modules: Iterable[nn.Module], row_counts: list[int]) -> int:
    """Run one :class:`PackedLinear` of each distinct shape among ``modules`` on zeros
    ``[rows, in_features]`` for every row count: oneDNN builds a kernel per (weight shape, row
    count) on first use and caches it for every weight of that shape, so a request's step does
    not pay for it.

    Returns how many calls were made (0 when nothing is packed)."""
    by_shape: dict[tuple[int, int, bool, torch.dtype], PackedLinear] = {}
    for m in modules:
        if isinstance(m, PackedLinear):
            key = (m.in_features, m.out_features, m.bias is not None, m.packed_weight.dtype)
            by_shape.setdefault(key, m)
    for rows in row_counts:
        for m in by_shape.values():
            m(torch.zeros(rows, m.in_features, dtype=m.packed_weight.dtype))
    return len(row_counts) * len(by_shape)
