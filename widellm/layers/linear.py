"""Linear layers: one module class, :class:`Linear`, whose weight format and kernel are its
*linear method* (``linear_method.py``), chosen when the model is loaded:

* ``plain``: ``F.linear`` (the reference; any device);
* ``onednn_packed``: bf16/fp32 CPU weights prepacked for oneDNN (``linear_onednn.py``), given
  after loading to every plain layer whose weight it can pack and nothing else shares (the LM
  head tied to the embedding gets a packed copy of its own);
* ``fp8_block``: DeepSeek-V3's FP8 weights with 128 x 128 block scales kept as they are
  (``linear_fp8.py``), given before loading to the layers whose checkpoint tensors are FP8 when
  the engine keeps FP8 weights (on CUDA).

:data:`LINEAR_METHODS` names them. The model code only ever builds ``Linear``; no class is
swapped after loading.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from widellm.layers.linear_fp8 import Fp8BlockLinearMethod
from widellm.layers.linear_method import LinearMethod, PlainLinearMethod
from widellm.layers.linear_onednn import (
    PACKABLE_DTYPES,
    PACKED_LINEAR_ENV,
    OneDNNPackedLinearMethod,
    can_pack,
    packed_linear_available,
    packed_linear_enabled,
)

__all__ = [
    "LINEAR_METHODS", "Linear", "PACKED_LINEAR_ENV", "linear_method_counts", "pack_linear",
    "pack_linear_weights", "packed_linear_available", "packed_linear_enabled", "use_fp8_weights",
    "warm_packed_linears",
]

LINEAR_METHODS: dict[str, type[LinearMethod]] = {
    cls.name: cls for cls in (PlainLinearMethod, OneDNNPackedLinearMethod, Fp8BlockLinearMethod)
}


class Linear(nn.Linear):
    """``nn.Linear`` computed by its :attr:`linear_method` (plain until the loader says
    otherwise). Parameters are ``nn.Linear``'s, or the method's own after its
    ``create_weights`` (FP8: a float8 ``weight`` and a ``weight_scale_inv``).

    forward: x ``[..., in_features]`` -> ``[..., out_features]``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.linear_method: LinearMethod = PlainLinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x)

    def dense_weight(self) -> torch.Tensor:
        """The real ``[out, in]`` weight in the model dtype, for load-time hooks."""
        return self.linear_method.dense_weight(self)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", method={self.linear_method.name}"


def _plain(m: nn.Module) -> bool:
    return isinstance(m, Linear) and type(m.linear_method) is PlainLinearMethod


def use_fp8_weights(model: nn.Module, names: Iterable[str], block_size: tuple[int, int],
                    kernel: str = "auto") -> int:
    """Give the ``Linear`` modules ``names`` of ``model`` the FP8 block method, before the
    checkpoint is loaded (their parameters become a float8 weight and its block scales).
    Returns how many layers changed."""
    modules = dict(model.named_modules())
    count = 0
    for name in names:
        layer = modules.get(name)
        if not _plain(layer):
            raise ValueError(f"{name!r} is no plain widellm Linear of the model")
        method = Fp8BlockLinearMethod(block_size, kernel)
        method.create_weights(layer)
        layer.linear_method = method
        count += 1
    return count


def pack_linear(layer: Linear) -> None:
    """Give one loaded plain ``Linear`` the oneDNN-packed method, in place; its plain weight is
    released (freed unless something else still holds the tensor)."""
    method = OneDNNPackedLinearMethod()
    method.process_weights_after_loading(layer)
    layer.linear_method = method


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
    """Give the oneDNN-packed method to every plain ``Linear`` of ``model`` whose weight is
    bf16 or fp32 on CPU, of a dtype oneDNN computes here (:func:`packed_linear_available`), and
    not shared.

    Run it after the weights are loaded and every ``process_weights_after_loading`` hook has
    run: nothing may read a packed layer's ``weight`` afterwards (calling it is fine). A
    ``Linear`` whose weight storage another tensor of the model also holds is left plain, except
    the LM head, which gets a packed copy of its own (its largest matmul of a small model's
    decode step; the embedding keeps the plain weight).

    Args:
        model: the loaded model, in eval use (the packed op has no backward).
        enabled: None reads :data:`PACKED_LINEAR_ENV`.

    Returns:
        How many layers were packed (0 when disabled or oneDNN cannot run the dtypes here).
    """
    if enabled is None:
        enabled = packed_linear_enabled()
    if not enabled:
        return 0
    available = {dtype: packed_linear_available(dtype) for dtype in PACKABLE_DTYPES}

    def packable(m: nn.Module) -> bool:
        return _plain(m) and can_pack(m.weight) and available[m.weight.dtype]

    refs = _storage_refs(model)
    targets = [
        m for m in model.modules()
        if packable(m) and refs[m.weight.untyped_storage().data_ptr()] == 1
    ]
    lm_head = getattr(model, "lm_head", None)
    if packable(lm_head) and lm_head not in targets:
        targets.append(lm_head)
    for m in targets:
        pack_linear(m)
    return len(targets)


def linear_method_counts(model: nn.Module) -> dict[str, int]:
    """How many ``Linear`` layers of ``model`` run each method, e.g. ``{"onednn_packed": 9}``."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, Linear):
            counts[m.linear_method.name] = counts.get(m.linear_method.name, 0) + 1
    return counts


def warm_packed_linears(modules: Iterable[nn.Module], row_counts: list[int]) -> int:
    """Run one oneDNN-packed ``Linear`` of each distinct shape among ``modules`` on zeros
    ``[rows, in_features]`` for every row count: oneDNN builds a kernel per (weight shape, row
    count) on first use and caches it for every weight of that shape, so a request's step does
    not pay for it.

    Returns how many calls were made (0 when nothing is packed)."""
    by_shape: dict[tuple[int, int, bool, torch.dtype], Linear] = {}
    for m in modules:
        if isinstance(m, Linear) and isinstance(m.linear_method, OneDNNPackedLinearMethod):
            key = (m.in_features, m.out_features, m.bias is not None, m.packed_weight.dtype)
            by_shape.setdefault(key, m)
    for rows in row_counts:
        for m in by_shape.values():
            m(torch.zeros(rows, m.in_features, dtype=m.packed_weight.dtype))
    return len(row_counts) * len(by_shape)
