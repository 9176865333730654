"""Loading DeepSeek-V3 FP8 checkpoints (format in ``fp8.py``).

The loader reads ``quantization_config`` from config.json (:meth:`Fp8BlockQuantConfig.
from_hf_config`) and, when present, passes the checkpoint's tensor stream through
:func:`fp8_block_weights`, which pairs every float8_e4m3fn ``X.weight`` with its
``X.weight_scale_inv`` (in either order, in the same or another shard file) and hands the model
one tensor per weight, in the form the weight's layer takes (the loader decides per layer,
``fp8_layers.py``):

* dequantized to the model dtype (every layer on CPU, and the layers that cannot keep FP8): the
  model's plain or oneDNN-packed ``Linear`` weights load unchanged and ``weight_scale_inv``
  never reaches the model;
* kept as FP8 plus its scale, for the layers given the FP8 block linear method
  (``widellm/layers/linear_fp8.py``), which own a float8 ``weight`` and a fp32
  ``weight_scale_inv``.

Non-FP8 tensors (embeddings, norms, the router gate, lm_head) pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from widellm.model.fp8 import (
    ACTIVATION_SCHEME_DYNAMIC,
    FMT_E4M3,
    FP8_DTYPE,
    QUANT_METHOD_FP8,
    SCALE_INV_SUFFIX,
    check_scale_shape,
    dequantize_weight_block_fp8,
)

# config.json keys
QUANTIZATION_CONFIG_KEY = "quantization_config"
BLOCK_DIMS = 2  # weight_block_size is [rows, columns]


@dataclass(frozen=True, slots=True)
class Fp8BlockQuantConfig:
    """A checkpoint's ``quantization_config`` for DeepSeek-V3's block FP8 format.

    Attributes:
        weight_block_size: (rows, columns) covered by one ``weight_scale_inv`` entry.
        activation_scheme: "dynamic" (activations quantized per token-group at run time by
            the FP8 linear method; nothing to load for them).
    """

    weight_block_size: tuple[int, int]
    activation_scheme: str = ACTIVATION_SCHEME_DYNAMIC

    def __post_init__(self) -> None:
        if len(self.weight_block_size) != BLOCK_DIMS or min(self.weight_block_size) <= 0:
            raise ValueError(
                f"weight_block_size must be two positive sizes, got {self.weight_block_size}"
            )
        if self.activation_scheme != ACTIVATION_SCHEME_DYNAMIC:
            # A static scheme ships per-layer input scales no linear here consumes.
            raise ValueError(
                f"FP8 activation_scheme {self.activation_scheme!r} is not supported "
                f"(only {ACTIVATION_SCHEME_DYNAMIC!r})"
            )

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> Fp8BlockQuantConfig | None:
        """The config's block-FP8 quantization, None for an unquantized checkpoint.

        Raises ValueError for a quantization this engine cannot load (another method, a
        format other than e4m3, per-tensor FP8 without ``weight_block_size``), rather than
        failing later on tensors the model has no place for."""
        raw = getattr(hf_config, QUANTIZATION_CONFIG_KEY, None)
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raw = raw.to_dict()  # a transformers QuantizationConfig object
        method = raw.get("quant_method")
        if method != QUANT_METHOD_FP8:
            raise ValueError(
                f"quantization_config.quant_method {method!r} is not supported "
                f"(only DeepSeek-V3's block {QUANT_METHOD_FP8!r})"
            )
        fmt = raw.get("fmt", FMT_E4M3)
        if fmt != FMT_E4M3:
            raise ValueError(f"FP8 fmt {fmt!r} is not supported (only {FMT_E4M3!r})")
        block = raw.get("weight_block_size")
        if block is None:
            raise ValueError("per-tensor FP8 (no weight_block_size) is not supported")
        return cls(
            weight_block_size=tuple(int(b) for b in block),
            activation_scheme=raw.get("activation_scheme", ACTIVATION_SCHEME_DYNAMIC),
        )


def scale_inv_name(weight_name: str) -> str:
    """``"X.weight"`` -> ``"X.weight_scale_inv"``."""
    return weight_name + SCALE_INV_SUFFIX


def with_scales(skip: Callable[[str], bool] | None) -> Callable[[str], bool] | None:
    """A loader skip predicate that also skips ``X.weight_scale_inv`` whenever it skips
    ``X.weight``, so an expert-parallel rank reads neither half of another rank's experts."""
    if skip is None:
        return None

    def skip_pair(name: str) -> bool:
        if name.endswith(SCALE_INV_SUFFIX):
            return skip(name[: -len(SCALE_INV_SUFFIX)])
        return skip(name)

    return skip_pair


def fp8_block_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    quant: Fp8BlockQuantConfig,
    dtype: torch.dtype,
    keep_fp8: bool | Callable[[str], bool] = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) stream with every FP8 weight joined to its scale.

    A weight and its scale are held only until the other arrives (adjacent in DeepSeek's
    files, so at most one pair is held); every other tensor passes through as it comes.

    Args:
        weights: (HF name, tensor) pairs from the checkpoint.
        quant: the checkpoint's block-FP8 config.
        dtype: the model dtype dequantized weights are produced in.
        keep_fp8: which FP8 weights (by name) stay FP8; a bool applies to all of them.

    Yields:
        ``(X.weight, [out, in] dtype)`` for each FP8 weight when dequantizing; when keeping
        FP8, ``(X.weight, [out, in] float8_e4m3fn)`` then ``(X.weight_scale_inv, fp32
        [ceil(out/bo), ceil(in/bi)])``; other tensors unchanged.

    Raises:
        ValueError: an FP8 weight without its scale, a scale without an FP8 weight, or a
            scale whose shape does not fit its weight's blocks.
    """
    keep = keep_fp8 if callable(keep_fp8) else (lambda _name: keep_fp8)
    block = quant.weight_block_size
    waiting_weights: dict[str, torch.Tensor] = {}  # weight name -> fp8 weight
    waiting_scales: dict[str, torch.Tensor] = {}  # weight name -> its scale

    def joined(name: str, q: torch.Tensor, scale_inv: torch.Tensor):
        # Both sides of the seam reject a scale grid that does not fit, naming the tensor.
        try:
            check_scale_shape(q, scale_inv, block)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        if keep(name):
            yield name, q
            yield scale_inv_name(name), scale_inv
        else:
            yield name, dequantize_weight_block_fp8(q, scale_inv, dtype, block)

    for name, tensor in weights:
        if name.endswith(SCALE_INV_SUFFIX):
            weight_name = name[: -len(SCALE_INV_SUFFIX)]
            q = waiting_weights.pop(weight_name, None)
            if q is None:
                waiting_scales[weight_name] = tensor
            else:
                yield from joined(weight_name, q, tensor)
        elif tensor.dtype == FP8_DTYPE:
            scale_inv = waiting_scales.pop(name, None)
            if scale_inv is None:
                waiting_weights[name] = tensor
            else:
                yield from joined(name, tensor, scale_inv)
        else:
            yield name, tensor
    if waiting_weights:
        raise ValueError(
            f"{len(waiting_weights)} FP8 weights have no matching *.weight{SCALE_INV_SUFFIX}, "
            f"e.g. {sorted(waiting_weights)[:3]}"
        )
    if waiting_scales:
        names = [scale_inv_name(n) for n in sorted(waiting_scales)[:3]]
        raise ValueError(
            f"{len(waiting_scales)} scales have no float8_e4m3fn weight, e.g. {names}"
        )

