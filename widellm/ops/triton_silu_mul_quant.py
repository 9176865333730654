"""Fused SiLU-and-mul of the MoE experts (optionally quantized to FP8) and per-token-group FP8
quantization, as Triton kernels with their plain torch twins.

``x [T, 2I]`` holds the fused gate/up projection as ``[gate | up]``; the activation is
``silu(gate) * up`` computed in fp32. It comes out either in x's dtype (rounded once) or as
DeepGEMM's 1 x 128 activation format: ``q [T, I] float8_e4m3fn`` and ``scales [T, I // 128]
float32`` with, per token and group of 128 columns, ``scale = max(max|group|, eps) / 448`` and
``q = round_to_nearest_even_e4m3(clamp(value / scale, -448, 448))``; where I is no multiple of
128, a last partial group has its own scale (``cdiv`` scales, as the FP8 grouped GEMM reads
them). The quantized form is taken from the fp32 activation, not from a bf16 rounding of it (one
rounding fewer than quantizing :func:`silu_and_mul`'s output). :func:`per_token_group_quant`
applies the same quantization to an existing ``[T, K]`` tensor (the grouped GEMM's input).

Padding rows are given by any of ``num_valid_rows`` (rows at or past it: CUDA-graph padding at
the end), ``row_ids`` (negative ids: DeepSeek's -1 rows of the contiguous MoE layout) and
``counts`` (per expert of the masked layout ``[E, C, ...]``, rows past the expert's count).
They are never read and come out as a zero row would: zeros, and for the quantized form q = 0
with the scale of an all-zero group (``eps / 448``).

Why software rounding: Triton 3.9's interpreter rounds fp32 -> e4m3 wrongly (it drops the
carry into the exponent: 1.97 -> 1.0; ties and subnormals are off too) and truncates fp32 ->
bf16, so where the kernels run interpreted (CPU tensors) the e4m3 and bf16 bits are built from
the fp32 bits with integer round-to-nearest-even; on CUDA the hardware conversions (cvt.rn) are
used. Both give torch's bits; on CUDA either can be chosen (``software_rounding``) to test both.
Where the GPU has no e4m3 conversion (AMD, NVIDIA before Ada) the software path is the default.
Divisions use ``div_rn`` because Triton's ``/`` on fp32 is approximate on NVIDIA GPUs and the
twin divides exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Largest finite float8_e4m3fn value (0x7E): the quantized range is [-448, 448].
FP8_E4M3_MAX = 448.0
# DeepGEMM's activation group: 1 x 128 values share a scale.
QUANT_GROUP_SIZE = 128
# Floor for a group's max |value|, so an all-zero group gets a finite, nonzero scale.
AMAX_EPSILON = 1e-10
# NVIDIA compute capability from which the hardware converts fp32 to e4m3 (Ada, Hopper).
FP8_CAST_MIN_CAPABILITY = (8, 9)
# Tile of one program: rows x columns (a quantization group or BLOCK_COLS plain outputs).
BLOCK_ROWS = 16
BLOCK_COLS = 128

# fp32 -> e4m3 in integer arithmetic (see the module docstring): fp32 bits of 2^-6, e4m3's
# smallest normal; the exponent re-bias 127 -> 7 in e4m3's bit position (3 mantissa bits);
# below 2^-6, e4m3 counts multiples of 2^-9, rounded by adding 2^23 (fp32 bits 0x4B000000),
# whose ulp is 1.
_F32_BITS_E4M3_MIN_NORMAL = tl.constexpr(0x3C800000)
_E4M3_REBIAS = tl.constexpr((127 - 7) << 3)
_E4M3_SUBNORMAL_UNITS = tl.constexpr(512.0)
_TWO_POW_23 = tl.constexpr(8388608.0)
_F32_BITS_TWO_POW_23 = tl.constexpr(0x4B000000)
_F32_BITS_INF = tl.constexpr(0x7F800000)
_E4M3_NAN = tl.constexpr(0x7F)
# fp32 -> bf16 keeps the top 16 bits; a NaN stays quiet by setting bf16's top mantissa bit.
_BF16_QUIET_NAN_BIT = tl.constexpr(0x40)
# The public constants as the kernels see them.
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_AMAX_EPS = tl.constexpr(AMAX_EPSILON)


@triton.jit
def _e4m3_bits_rtne(v):
    """fp32 [...] with |v| <= 448 (or NaN) -> int32 [...] float8_e4m3fn bit patterns, rounded
    to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal: round the 20 dropped mantissa bits to nearest even; a carry moves into the
    # exponent field, which is what rounding up to the next binade needs.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - _E4M3_REBIAS
    # Subnormal (and zero): |v| / 2^-9 rounded to an integer by the fp32 adder itself.
    subnormal = (tl.abs(v) * _E4M3_SUBNORMAL_UNITS + _TWO_POW_23).to(tl.int32, bitcast=True)
    code = tl.where(mag < _F32_BITS_E4M3_MIN_NORMAL, subnormal - _F32_BITS_TWO_POW_23, normal)
    code = tl.where(mag > _F32_BITS_INF, _E4M3_NAN, code)
    return code | sign


@triton.jit
def _bf16_bits_rtne(v):
    """fp32 [...] -> uint32 [...] whose low 16 bits are the bfloat16 bits, rounded to nearest
    even."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where((bits & 0x7FFFFFFF) > _F32_BITS_INF, (bits >> 16) | _BF16_QUIET_NAN_BIT,
                    rounded)


@triton.jit
def _valid_rows(rows, num_rows, num_live_rows, valid_count_ptr, row_ids_ptr, counts_ptr,
                rows_per_expert, HAS_VALID_COUNT: tl.constexpr, HAS_ROW_IDS: tl.constexpr,
                HAS_COUNTS: tl.constexpr):
    """int32 [BLOCK_ROWS] row indices -> bool [BLOCK_ROWS]: the row exists and is not padding."""
    in_range = rows < num_rows
    valid = in_range & (rows < num_live_rows)
    if HAS_VALID_COUNT:
        valid = valid & (rows < tl.load(valid_count_ptr))
    if HAS_ROW_IDS:
        valid = valid & (tl.load(row_ids_ptr + rows, mask=in_range, other=-1) >= 0)
    if HAS_COUNTS:
        count = tl.load(counts_ptr + rows // rows_per_expert, mask=in_range, other=0)
        valid = valid & (rows % rows_per_expert < count)
    return valid


@triton.jit
def _silu_mul_tile(x_ptr, rows, cols, valid, col_mask, stride_x, inter):
    """fp32 [BLOCK_ROWS, C] silu(gate) * up for the given rows/columns; 0 on invalid rows."""
    offs = rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
    mask = valid[:, None] & col_mask[None, :]
    gate = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + offs + inter, mask=mask, other=0.0).to(tl.float32)
    return tl.math.div_rn(gate, 1.0 + tl.exp(-gate)) * up


@triton.jit
def _quantize_store(v, rows, group, num_rows, cols, width, q_ptr, stride_q, s_ptr, stride_s,
                    SOFTWARE_ROUNDING: tl.constexpr):
    """Quantize fp32 v [BLOCK_ROWS, GROUP] (one group per row; 0 past width) and store q (uint8
    view of e4m3) and the per-row scales."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), _AMAX_EPS)
    scale = tl.math.div_rn(amax, _FP8_MAX)
    y = tl.math.div_rn(v, scale[:, None])
    y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
    if SOFTWARE_ROUNDING:
        code = _e4m3_bits_rtne(y).to(tl.uint8)
    else:
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    row_mask = rows < num_rows
    rows64 = rows.to(tl.int64)
    tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], code,
             mask=row_mask[:, None] & (cols < width)[None, :])
    tl.store(s_ptr + rows64 * stride_s + group, scale, mask=row_mask)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, valid_count_ptr, row_ids_ptr, counts_ptr, num_rows,
                     num_live_rows, rows_per_expert, inter, stride_x, stride_out,
                     HAS_VALID_COUNT: tl.constexpr, HAS_ROW_IDS: tl.constexpr,
                     HAS_COUNTS: tl.constexpr, SOFTWARE_BF16: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    valid = _valid_rows(rows, num_rows, num_live_rows, valid_count_ptr, row_ids_ptr,
                        counts_ptr, rows_per_expert, HAS_VALID_COUNT, HAS_ROW_IDS, HAS_COUNTS)
    v = _silu_mul_tile(x_ptr, rows, cols, valid, col_mask, stride_x, inter)
    offs = rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    mask = (rows < num_rows)[:, None] & col_mask[None, :]
    if SOFTWARE_BF16:  # out_ptr is an int16 view of the bf16 output
        tl.store(out_ptr + offs, _bf16_bits_rtne(v).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, valid_count_ptr, row_ids_ptr, counts_ptr, num_rows,
                  num_live_rows, rows_per_expert, width, stride_x, stride_q, stride_s,
                  HAS_VALID_COUNT: tl.constexpr, HAS_ROW_IDS: tl.constexpr,
                  HAS_COUNTS: tl.constexpr, SILU_MUL: tl.constexpr,
                  SOFTWARE_ROUNDING: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """Program (row tile, group): q/scales of x's rows [BLOCK_M, GROUP], or with SILU_MUL of
    silu(gate) * up where x's rows are [gate (width) | up (width)]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    valid = _valid_rows(rows, num_rows, num_live_rows, valid_count_ptr, row_ids_ptr,
                        counts_ptr, rows_per_expert, HAS_VALID_COUNT, HAS_ROW_IDS, HAS_COUNTS)
    if SILU_MUL:
        v = _silu_mul_tile(x_ptr, rows, cols, valid, cols < width, stride_x, width)
    else:
        offs = rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
        mask = valid[:, None] & (cols < width)[None, :]
        v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _quantize_store(v, rows, group, num_rows, cols, width, q_ptr, stride_q, s_ptr, stride_s,
                    SOFTWARE_ROUNDING)


def _padding_args(x: torch.Tensor, x2: torch.Tensor, num_valid_rows, row_ids, counts) -> dict:
    """Kernel arguments describing the padding rows of x [..., C] (x2: its [T, C] rows)."""
    T = x2.shape[0]
    count_is_tensor = isinstance(num_valid_rows, torch.Tensor)
    if row_ids is not None:
        row_ids = row_ids.reshape(-1).contiguous()
        if row_ids.numel() != T or row_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"row_ids must be {T} int32/int64 values, got "
                             f"{row_ids.numel()} {row_ids.dtype}")
    if counts is not None and (x.dim() != 3 or counts.shape != (x.shape[0],)):
        raise ValueError(f"counts [E] needs x [E, rows_per_expert, C], got "
                         f"{tuple(counts.shape)} for x {tuple(x.shape)}")
    return dict(
        valid_count_ptr=num_valid_rows if count_is_tensor else x2,
        row_ids_ptr=row_ids if row_ids is not None else x2,
        counts_ptr=counts if counts is not None else x2,
        num_rows=T,
        num_live_rows=T if num_valid_rows is None or count_is_tensor else min(T, num_valid_rows),
        rows_per_expert=max(1, x.shape[1]) if counts is not None else 1,
        HAS_VALID_COUNT=count_is_tensor,
        HAS_ROW_IDS=row_ids is not None,
        HAS_COUNTS=counts is not None,
    )


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] -> [T, C] with a unit column stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _software_rounding(x: torch.Tensor, software_rounding: bool | None) -> bool:
    """Round in integer arithmetic: asked for, or by default where the interpreter runs or the
    GPU has no e4m3 conversion (AMD, NVIDIA before Ada)."""
    if software_rounding is not None:
        return software_rounding
    return (x.device.type != "cuda" or torch.version.hip is not None
            or torch.cuda.get_device_capability(x.device) < FP8_CAST_MIN_CAPABILITY)


def silu_and_mul(x: torch.Tensor, num_valid_rows: int | torch.Tensor | None = None,
                 row_ids: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None,
                 software_rounding: bool | None = None) -> torch.Tensor:
    """x [..., 2I] (bf16/fp16/fp32; gate first, up second) -> [..., I] silu(gate) * up, computed
    in fp32 and rounded once to out_dtype (default x's dtype).

    Padding rows, not read and output as zeros, are those marked by any of: num_valid_rows (an
    int, or a one-element int tensor on x's device for CUDA graphs: rows at or past it);
    row_ids ([...] int32/int64: negative); counts ([E] int32/int64 with x [E, C, 2I], the masked
    MoE layout: row c of expert e when c >= counts[e]). software_rounding: see the module
    docstring (default: off on CUDA GPUs that convert to e4m3 in hardware, on elsewhere)."""
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=out_dtype or x.dtype, device=x.device)
    x2, out2 = _rows_2d(x), out.view(-1, inter)
    if out2.numel() == 0:
        return out
    software_bf16 = out.dtype == torch.bfloat16 and _software_rounding(x, software_rounding)
    grid = (triton.cdiv(x2.shape[0], BLOCK_ROWS), triton.cdiv(inter, BLOCK_COLS))
    _silu_mul_kernel[grid](x2, out2.view(torch.int16) if software_bf16 else out2, inter=inter,
                           stride_x=x2.stride(0), stride_out=out2.stride(0),
                           SOFTWARE_BF16=software_bf16, BLOCK_M=BLOCK_ROWS, BLOCK_N=BLOCK_COLS,
                           **_padding_args(x, x2, num_valid_rows, row_ids, counts))
    return out


def silu_and_mul_quant(x: torch.Tensor, num_valid_rows: int | torch.Tensor | None = None,
                       row_ids: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                       group_size: int = QUANT_GROUP_SIZE,
                       software_rounding: bool | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2I] (gate first, up second) -> (q [..., I] float8_e4m3fn, scales [..., cdiv(I,
    group_size)] float32) of the fp32 silu(gate) * up (a last partial group counts its own
    columns). Padding and software_rounding as :func:`silu_and_mul`."""
    return _quantize(x, x.shape[-1] // 2, True, num_valid_rows, row_ids, counts, group_size,
                     software_rounding)


def per_token_group_quant(x: torch.Tensor, num_valid_rows: int | torch.Tensor | None = None,
                          row_ids: torch.Tensor | None = None,
                          counts: torch.Tensor | None = None,
                          group_size: int = QUANT_GROUP_SIZE,
                          software_rounding: bool | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (bf16/fp16/fp32) -> (q [..., K] float8_e4m3fn, scales [..., cdiv(K,
    group_size)] float32): the quantization of :func:`silu_and_mul_quant` applied to x itself.
    Padding and software_rounding as :func:`silu_and_mul`."""
    return _quantize(x, x.shape[-1], False, num_valid_rows, row_ids, counts, group_size,
                     software_rounding)


def _quantize(x: torch.Tensor, width: int, silu_mul: bool, num_valid_rows, row_ids, counts,
              group_size: int, software_rounding: bool | None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`_quant_kernel` on x [..., C]; returns (q [..., width], scales)."""
    if group_size <= 0 or group_size & (group_size - 1):
        raise ValueError(f"group_size {group_size} must be a power of two")
    num_groups = triton.cdiv(width, group_size)
    q = torch.empty(*x.shape[:-1], width, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(*x.shape[:-1], num_groups, dtype=torch.float32, device=x.device)
    x2 = _rows_2d(x)
    q2 = q.view(torch.uint8).view(-1, width)
    s2 = scales.view(-1, num_groups)
    if q2.numel() == 0:
        return q, scales
    grid = (triton.cdiv(q2.shape[0], BLOCK_ROWS), num_groups)
    _quant_kernel[grid](x2, q2, s2, width=width, stride_x=x2.stride(0), stride_q=q2.stride(0),
                        stride_s=s2.stride(0), SILU_MUL=silu_mul,
                        SOFTWARE_ROUNDING=_software_rounding(x, software_rounding),
                        BLOCK_M=BLOCK_ROWS, GROUP=group_size,
                        **_padding_args(x, x2, num_valid_rows, row_ids, counts))
    return q, scales


# ---- plain torch twins -----------------------------------------------------------------------

def padding_row_mask_reference(x: torch.Tensor, num_valid_rows=None, row_ids=None,
                               counts=None) -> torch.Tensor:
    """[T] bool over x [..., C]'s rows: True for the rows that are not padding."""
    num_rows = x.shape[:-1].numel()
    index = torch.arange(num_rows, device=x.device)
    valid = torch.ones(num_rows, dtype=torch.bool, device=x.device)
    if num_valid_rows is not None:
        valid &= index < num_valid_rows
    if row_ids is not None:
        valid &= row_ids.reshape(-1) >= 0
    if counts is not None:
        rows_per_expert = x.shape[1]
        valid &= index % rows_per_expert < counts.repeat_interleave(rows_per_expert)
    return valid


def silu_and_mul_fp32_reference(x: torch.Tensor, num_valid_rows=None, row_ids=None,
                                counts=None) -> torch.Tensor:
    """x [..., 2I] -> [..., I] fp32 silu(gate) * up, zero on padding rows."""
    inter = x.shape[-1] // 2
    valid = padding_row_mask_reference(x, num_valid_rows, row_ids, counts)
    x2 = torch.where(valid[:, None], x.reshape(-1, x.shape[-1]).float(), 0.0)
    return (F.silu(x2[:, :inter]) * x2[:, inter:]).view(*x.shape[:-1], inter)


def silu_and_mul_reference(x: torch.Tensor, num_valid_rows=None, row_ids=None, counts=None,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Twin of :func:`silu_and_mul`."""
    return silu_and_mul_fp32_reference(x, num_valid_rows, row_ids, counts).to(
        out_dtype or x.dtype)


def per_token_group_quant_reference(x: torch.Tensor, num_valid_rows=None, row_ids=None,
                                    counts=None, group_size: int = QUANT_GROUP_SIZE,
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`per_token_group_quant`: zero padding rows, zero-fill a partial last
    group, then max, scale and round per group."""
    width = x.shape[-1]
    valid = padding_row_mask_reference(x, num_valid_rows, row_ids, counts)
    x2 = torch.where(valid[:, None], x.reshape(-1, width).float(), 0.0)
    num_groups = -(-width // group_size)
    x2 = F.pad(x2, (0, num_groups * group_size - width))
    groups = x2.view(x2.shape[0], num_groups, group_size)
    scales = groups.abs().amax(dim=-1).clamp(min=AMAX_EPSILON) / FP8_E4M3_MAX
    y = (groups / scales[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = y.to(torch.float8_e4m3fn).view(x2.shape)[:, :width]
    return q.reshape(x.shape), scales.view(*x.shape[:-1], num_groups)


def silu_and_mul_quant_reference(x: torch.Tensor, num_valid_rows=None, row_ids=None,
                                 counts=None, group_size: int = QUANT_GROUP_SIZE,
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`silu_and_mul_quant`: the fp32 activation, then its group quantization."""
    return per_token_group_quant_reference(
        silu_and_mul_fp32_reference(x, num_valid_rows, row_ids, counts), group_size=group_size)
