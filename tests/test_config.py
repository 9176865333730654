"""``--dtype auto``: bf16 only where the CPU has native bf16 matmuls."""

from __future__ import annotations

import pytest
import torch

from widellm.config import auto_dtype, resolve_dtype


@pytest.mark.parametrize("native_bf16,expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_follows_native_bf16(native_bf16, expected, monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native_bf16)
    assert auto_dtype() is expected
    assert resolve_dtype("auto") is expected


def test_auto_dtype_on_this_cpu():
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert resolve_dtype("auto") is (torch.bfloat16 if native else torch.float32)


def test_named_dtypes_and_errors():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8")
