"""DeepSeek-V3's FP8 weight format: 128 x 128 block-scaled float8_e4m3fn.

A quantized linear ``X`` is stored as two tensors (DeepSeek-V3/R1's released checkpoints, and
their ``config.json`` ``quantization_config``: ``quant_method "fp8"``, ``fmt "e4m3"``,
``activation_scheme "dynamic"``, ``weight_block_size [128, 128]``):

* ``X.weight``           float8_e4m3fn ``[out, in]``
* ``X.weight_scale_inv`` float32 ``[ceil(out / 128), ceil(in / 128)]``

and the real weight is ``X.weight[r, c] * X.weight_scale_inv[r // 128, c // 128]``: one scale
per 128 x 128 block, the last block of a row or column partial when the size is not a multiple
of 128 (DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 rows: 4 full row blocks and one of 64).
"scale_inv" because it is the inverse of the quantization scale: quantizing divides by it.

This file holds the format's constants and the two pure conversions, each with a plain
block-by-block reference twin; loading lives in ``fp8_weights.py``, writing presets in
``presets_fp8.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
# Largest finite e4m3fn value (no infinities in this format): a block's largest |w| maps here.
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
WEIGHT_BLOCK_SIZE = (128, 128)  # (rows, columns) per scale, DeepSeek-V3's
SCALE_DTYPE = torch.float32

# The quantization_config DeepSeek-V3 writes into config.json, field by field.
QUANT_METHOD_FP8 = "fp8"
FMT_E4M3 = "e4m3"
ACTIVATION_SCHEME_DYNAMIC = "dynamic"
# "X.weight" -> "X.weight_scale_inv"
SCALE_INV_SUFFIX = "_scale_inv"
# An all-zero block has amax 0; any finite scale dequantizes its zeros back to zeros, and 1.0
# avoids dividing by zero when quantizing.
ZERO_BLOCK_SCALE_INV = 1.0


def deepseek_fp8_quantization_config(
    block_size: tuple[int, int] = WEIGHT_BLOCK_SIZE,
) -> dict[str, object]:
    """The ``quantization_config`` entry of DeepSeek-V3's config.json for this format."""
    return {
        "activation_scheme": ACTIVATION_SCHEME_DYNAMIC,
        "fmt": FMT_E4M3,
        "quant_method": QUANT_METHOD_FP8,
        "weight_block_size": list(block_size),
    }


def scale_grid(
    shape: torch.Size | tuple[int, ...], block_size: tuple[int, int] = WEIGHT_BLOCK_SIZE
) -> tuple[int, int]:
    """Shape of the scale tensor of a ``[out, in]`` weight: ``(ceil(out/bo), ceil(in/bi))``."""
    if len(shape) != 2:
        raise ValueError(f"block FP8 weights are 2-D [out, in], got shape {tuple(shape)}")
    return math.ceil(shape[0] / block_size[0]), math.ceil(shape[1] / block_size[1])


def _blocked(x: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """[out, in] fp32 -> [n_out_blocks, bo, n_in_blocks, bi], zero-padded at the far edges
    (zeros change no block's amax, and the padding is sliced off again afterwards)."""
    n_out, n_in = scale_grid(x.shape, block_size)
    bo, bi = block_size
    padded = F.pad(x, (0, n_in * bi - x.shape[1], 0, n_out * bo - x.shape[0]))
    return padded.view(n_out, bo, n_in, bi)


def _unblocked(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`_blocked`: [n_out_blocks, bo, n_in_blocks, bi] -> ``shape``."""
    n_out, bo, n_in, bi = blocks.shape
    return blocks.reshape(n_out * bo, n_in * bi)[: shape[0], : shape[1]]


def quantize_weight_block_fp8(
    w: torch.Tensor, block_size: tuple[int, int] = WEIGHT_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight into DeepSeek-V3's format.

    Per block, ``scale_inv = amax(|w_block|) / 448`` and ``q = w_block / scale_inv`` rounded to
    nearest-even e4m3 (so the block's largest value becomes exactly +-448).

    Args:
        w: [out, in] weight, any float dtype (converted to fp32 first).
        block_size: (rows, columns) of one scale block.

    Returns:
        q: [out, in] float8_e4m3fn.
        scale_inv: [ceil(out/bo), ceil(in/bi)] float32.

    Example (one partial block; 3.5 / 448 = 2**-7, so everything is exact)::

        w = [[0.5, -1.75, 3.5]]  ->  q = [[64., -224., 448.]], scale_inv = [[0.0078125]]
    """
    blocks = _blocked(w.detach().to(SCALE_DTYPE), block_size)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, ZERO_BLOCK_SCALE_INV)
    # amax / (amax / 448) can round to just above 448, which e4m3fn (no infinity) cannot hold.
    scaled = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = _unblocked(scaled, w.shape).to(FP8_DTYPE)
    return q.contiguous(), scale_inv.contiguous()


def dequantize_weight_block_fp8(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    block_size: tuple[int, int] = WEIGHT_BLOCK_SIZE,
) -> torch.Tensor:
    """The real weight of a DeepSeek-V3 FP8 tensor: ``q * scale_inv`` per block, in ``dtype``.

    The product is taken in fp32 (as DeepSeek's own ``weight_dequant`` does) and rounded once
    to ``dtype``, so fp32 results are the exact IEEE products ``float(q) * scale_inv``.

    Args:
        q: [out, in] float8_e4m3fn.
        scale_inv: [ceil(out/bo), ceil(in/bi)] float32.
        dtype: dtype of the result (the model's).
        block_size: (rows, columns) of one scale block.

    Returns:
        [out, in] ``dtype``.

    Example (continuing :func:`quantize_weight_block_fp8`'s)::

        q = [[64., -224., 448.]], scale_inv = [[0.0078125]]  ->  [[0.5, -1.75, 3.5]]
    """
    check_scale_shape(q, scale_inv, block_size)
    blocks = _blocked(q.to(SCALE_DTYPE), block_size)
    w = blocks * scale_inv.to(SCALE_DTYPE)[:, None, :, None]
    return _unblocked(w, q.shape).to(dtype).contiguous()


def check_scale_shape(
    q: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] = WEIGHT_BLOCK_SIZE
) -> None:
    """Raise ValueError unless ``scale_inv`` has one entry per block of the [out, in] ``q``."""
    expected = scale_grid(q.shape, block_size)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight "
            f"{tuple(q.shape)} in {block_size[0]}x{block_size[1]} blocks (expected {expected})"
        )


def _block_slices(
    shape: torch.Size, block_size: tuple[int, int]
) -> list[tuple[int, int, slice, slice]]:
    """(block row, block column, row slice, column slice) of every block, edges partial."""
    n_out, n_in = scale_grid(shape, block_size)
    bo, bi = block_size
    return [
        (i, j, slice(i * bo, min((i + 1) * bo, shape[0])),
         slice(j * bi, min((j + 1) * bi, shape[1])))
        for i in range(n_out) for j in range(n_in)
    ]


def quantize_weight_block_fp8_reference(
    w: torch.Tensor, block_size: tuple[int, int] = WEIGHT_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`quantize_weight_block_fp8`, one block at a time (same shapes, dtypes)."""
    w = w.detach().to(SCALE_DTYPE)
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    scale_inv = torch.empty(scale_grid(w.shape, block_size), dtype=SCALE_DTYPE)
    for i, j, rows, cols in _block_slices(w.shape, block_size):
        block = w[rows, cols]
        amax = block.abs().max()
        s = amax / FP8_MAX if amax > 0 else torch.tensor(ZERO_BLOCK_SCALE_INV)
        scale_inv[i, j] = s
        q[rows, cols] = (block / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv


def dequantize_weight_block_fp8_reference(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    block_size: tuple[int, int] = WEIGHT_BLOCK_SIZE,
) -> torch.Tensor:
    """Twin of :func:`dequantize_weight_block_fp8`, one block at a time."""
    check_scale_shape(q, scale_inv, block_size)
    w = torch.empty(q.shape, dtype=SCALE_DTYPE)
    for i, j, rows, cols in _block_slices(q.shape, block_size):
        w[rows, cols] = q[rows, cols].to(SCALE_DTYPE) * scale_inv[i, j].to(SCALE_DTYPE)
    return w.to(dtype)
