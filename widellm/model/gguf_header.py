"""A GGUF file's header, read fast: its metadata as plain Python values and its tensors as
read-only views of one memory map.

``gguf.GGUFReader`` (the reference twin, ``read_header_reference``) builds one numpy view per
header element: 2.6 s for SmolLM2's 98 MB file here, almost all of it the tokenizer's ~100,000
strings, and the default model's start-up read the header five times (config, end-of-sequence
ids, tokenizer, weights). This reader walks the same bytes with ``struct`` over an ``mmap``
(~0.1 s) and gives the same values and the same tensor arrays: ``tests/model/test_gguf_header``
compares the two on the default model and on a file holding every value type.

The format (GGUF v2 and v3, little-endian): magic, version, tensor count, metadata count;
each metadata entry is a key string, a value type and a value (arrays: element type, count,
elements); each tensor entry is a name, its dimensions (fastest-varying first), its ggml type
and its offset in the data section, which starts at the next multiple of
``general.alignment`` after the header. Big-endian files and arrays of arrays, which no
llama.cpp converter writes, are read by the reference reader instead.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, READER_SUPPORTED_VERSIONS,
    GGMLQuantizationType, GGUFReader, GGUFValueType,
)
from gguf.quants import quant_shape_to_byte_shape

# Little-endian struct format of each scalar value type.
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
# Tensor types stored as plain numbers (numpy reads them as they are); the rest are blocks of
# bytes that ``gguf.quants.dequantize`` decodes.
_PLAIN_TENSOR_DTYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_ALIGNMENT_KEY = "general.alignment"


class _NotFastReadable(Exception):
    """A file this reader leaves to the reference reader (big-endian, nested arrays)."""


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file. ``shape`` is in GGUF order (fastest-varying first; torch's is
    reversed); ``data`` is a read-only view of the file, shaped as ``gguf.GGUFReader`` shapes
    it: elements for plain types, ``[..., bytes per row]`` uint8 for block-quantized ones."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GgufHeader:
    """``metadata``: every key, ``GGUF.version`` / ``GGUF.tensor_count`` / ``GGUF.kv_count``
    included, as str, int, float, bool or lists of them (float32 scalars as the shortest
    decimal that rounds to the same float32: 1e-5, not 9.99999974e-06)."""

    metadata: dict[str, Any]
    tensors: list[GgufTensor]


def read_header(path: str) -> GgufHeader:
    """The header of the GGUF file at ``path`` (fast; the reference reader for the rare
    layouts it does not handle). Raises ValueError for a file that is not GGUF or is cut
    short."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _Walker(buf).header()
    except _NotFastReadable:
        return read_header_reference(path)
    except struct.error as e:  # a field runs past the end of the file
        raise ValueError(f"{path}: GGUF header cut short ({e})") from None


def read_header_reference(path: str) -> GgufHeader:
    """The same header through ``gguf.GGUFReader``: the plain twin of ``read_header``."""
    reader = GGUFReader(path)
    metadata = {}
    for key, reader_field in reader.fields.items():
        value = reader_field.contents()
        if reader_field.types == [GGUFValueType.FLOAT32]:
            value = _shortest_float32(value)
        metadata[key] = value
    tensors = [GgufTensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data)
               for t in reader.tensors]
    return GgufHeader(metadata, tensors)


def _shortest_float32(value: float) -> float:
    return float(str(np.float32(value)))


class _Walker:
    """Reads the header front to back; ``pos`` is the byte offset of the next field."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        start, self.pos = self.pos, self.pos + n
        return self.buf[start:self.pos].decode("utf-8")

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype != GGUFValueType.ARRAY:
            return self._unpack(_SCALAR_FORMATS[vtype])
        etype, count = GGUFValueType(self._unpack("<I")), self._unpack("<Q")
        if etype == GGUFValueType.STRING:
            return [self._string() for _ in range(count)]
        if etype == GGUFValueType.ARRAY:
            raise _NotFastReadable
        dtype = np.dtype(_SCALAR_FORMATS[etype])
        values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
        self.pos += dtype.itemsize * count
        return values

    def header(self) -> GgufHeader:
        if len(self.buf) < 8 or self._unpack("<I") != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._unpack("<I")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            raise _NotFastReadable
        if version not in READER_SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported")
        tensor_count, kv_count = self._unpack("<Q"), self._unpack("<Q")
        metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count,
                                    "GGUF.kv_count": kv_count}
        for _ in range(kv_count):
            key = self._string()
            vtype = GGUFValueType(self._unpack("<I"))
            value = self._value(vtype)
            if key in metadata:
                raise ValueError(f"GGUF key {key!r} appears twice")
            metadata[key] = _shortest_float32(value) if vtype == GGUFValueType.FLOAT32 else value
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, GGMLQuantizationType(self._unpack("<I")), dims,
                          self._unpack("<Q")))
        alignment = metadata.get(_ALIGNMENT_KEY, GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"GGUF {_ALIGNMENT_KEY} {alignment!r} is not a power of two")
        if len({info[0] for info in infos}) != len(infos):
            raise ValueError("GGUF file names a tensor twice")
        data_start = -(-self.pos // alignment) * alignment
        return GgufHeader(metadata, [self._tensor(data_start, *info) for info in infos])

    def _tensor(self, data_start: int, name: str, ttype: GGMLQuantizationType,
                dims: tuple[int, ...], offset: int) -> GgufTensor:
        n_elements = int(np.prod(dims))
        np_shape = tuple(reversed(dims))
        dtype = _PLAIN_TENSOR_DTYPES.get(ttype)
        if dtype is None:
            block_size, type_size = GGML_QUANT_SIZES[ttype]
            dtype, count = np.uint8, n_elements * type_size // block_size
            np_shape = quant_shape_to_byte_shape(np_shape, ttype)
        else:
            count = n_elements
        data = np.frombuffer(self.buf, dtype, count, data_start + offset).reshape(np_shape)
        return GgufTensor(name, ttype, dims, data)
