"""The fast GGUF header reader gives what ``gguf.GGUFReader`` (its reference twin) gives: on the
default model's file and on a written file holding every value type, a custom alignment,
plain and block-quantized tensors; big-endian files and nested arrays go to the reference."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFWriter
from gguf.quants import quantize

from widellm.model.default_model import default_model_path
from widellm.model.gguf_header import read_header, read_header_reference

ALIGNMENT = 64
PLAIN = np.arange(6, dtype=np.float32).reshape(2, 3)
HALF = np.arange(4, dtype=np.float16)
INTS = np.array([1, -2], dtype=np.int32)
ROWS = np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64)  # two Q8_0 blocks per row


def assert_same(fast, reference) -> None:
    assert fast.metadata == reference.metadata
    assert [type(v) for v in fast.metadata.values()] == [
        type(v) for v in reference.metadata.values()]
    assert len(fast.tensors) == len(reference.tensors)
    for a, b in zip(fast.tensors, reference.tensors):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, b.shape)
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape)
        assert np.array_equal(a.data, b.data)


def write_every_type(path: str, endianess: GGUFEndian = GGUFEndian.LITTLE,
                     nested: bool = False) -> None:
    w = GGUFWriter(path, "llama", endianess=endianess)
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_float32("t.f32", 1e-5)
    w.add_bool("t.b", True)
    w.add_uint64("t.u64", 2**63)
    w.add_int64("t.i64", -2**40)
    w.add_float64("t.f64", 0.1)
    w.add_string("t.s", "h\u00e9llo")
    w.add_array("t.strings", ["a", "", "\u00fc"])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, 1e-5])
    w.add_array("t.bools", [True, False])
    if nested:
        w.add_array("t.nested", [[1, 2], [3]])
    w.add_custom_alignment(ALIGNMENT)
    w.add_tensor("plain", PLAIN)
    w.add_tensor("half", HALF)
    w.add_tensor("q8", quantize(ROWS, GGMLQuantizationType.Q8_0),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("ints", INTS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_default_model_header_equals_the_reference():
    path = default_model_path()
    fast = read_header(path)
    assert_same(fast, read_header_reference(path))
    assert len(fast.tensors) == 272 and len(fast.metadata["tokenizer.ggml.tokens"]) == 49152


def test_every_value_type_and_tensor_kind(tmp_path):
    path = str(tmp_path / "every.gguf")
    write_every_type(path)
    fast = read_header(path)
    assert_same(fast, read_header_reference(path))
    m = fast.metadata
    assert (m["t.u8"], m["t.i8"], m["t.u16"], m["t.i16"]) == (7, -7, 65535, -300)
    assert (m["t.u32"], m["t.i32"], m["t.u64"], m["t.i64"]) == (4_000_000_000, -5, 2**63, -2**40)
    # A float32 scalar reads back as the decimal it was written as; arrays keep float32 values.
    assert (m["t.f32"], m["t.f64"], m["t.b"], m["t.s"]) == (1e-5, 0.1, True, "h\u00e9llo")
    assert m["t.floats"] == [0.5, float(np.float32(1e-5))]
    assert m["t.strings"] == ["a", "", "\u00fc"]
    assert (m["t.ints"], m["t.bools"]) == ([1, 2, 3], [True, False])
    assert (m["general.alignment"], m["GGUF.version"], m["GGUF.tensor_count"]) == (ALIGNMENT, 3, 4)
    tensors = {t.name: t for t in fast.tensors}
    assert tensors["plain"].shape == (3, 2) and np.array_equal(tensors["plain"].data, PLAIN)
    assert np.array_equal(tensors["half"].data, HALF) and np.array_equal(tensors["ints"].data, INTS)
    # Q8_0: 32 values per 34-byte block (a float16 scale, 32 int8), two blocks per row.
    assert tensors["q8"].tensor_type == GGMLQuantizationType.Q8_0
    assert tensors["q8"].shape == (64, 2) and tensors["q8"].data.shape == (2, 68)


@pytest.mark.parametrize("endianess, nested", [(GGUFEndian.BIG, False),
                                               (GGUFEndian.LITTLE, True)],
                         ids=["big-endian", "nested-array"])
def test_layouts_left_to_the_reference_reader(tmp_path, endianess, nested):
    path = str(tmp_path / "other.gguf")
    write_every_type(path, endianess, nested)
    fast = read_header(path)
    assert_same(fast, read_header_reference(path))
    if nested:
        assert fast.metadata["t.nested"] == [1, 2, 3]  # the reference flattens nested arrays


def test_not_a_gguf_file_or_one_cut_short(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="magic"):
        read_header(str(path))
    write_every_type(str(path))
    path.write_bytes(path.read_bytes()[:200])  # inside the metadata
    with pytest.raises(ValueError, match="cut short"):
        read_header(str(path))
