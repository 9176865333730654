"""Engine configuration: ``--dtype auto`` (bf16 only where the CPU has native bf16 matmuls) and
the dual-batch-overlap flags."""

from __future__ import annotations

import pytest
import torch

from tests.cpu_info import cpu_flags
from widellm.config import auto_dtype, resolve_dtype


@pytest.mark.parametrize("native_bf16,expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_follows_native_bf16(native_bf16, expected, monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native_bf16)
    assert auto_dtype() is expected
    assert resolve_dtype("auto") is expected


def test_auto_dtype_on_this_cpu():
    """The oracle is the CPU's own flags, not the oneDNN call auto_dtype makes."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this platform")
    if flags & {"avx512_bf16", "amx_bf16"}:
        assert resolve_dtype("auto") is torch.bfloat16
    elif not flags & {"avx512bw", "avx512f"}:
        assert resolve_dtype("auto") is torch.float32  # AVX2-only: bf16 would be emulated
    else:
        pytest.skip("AVX-512 without native bf16: oneDNN's answer has no flag-level oracle")


def test_named_dtypes_and_errors():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8")


def test_dbo_flags_take_vllms_names_and_an_auto_mode():
    import argparse

    from widellm.config import ParallelConfig
    from widellm.engine.arg_utils import EngineArgs, dbo_mode

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)

    def mode(*argv: str) -> str:
        return dbo_mode(EngineArgs.from_cli_args(parser.parse_args(list(argv))).enable_dbo)

    assert mode() == "off"
    assert mode("--enable-dbo") == "on"
    assert mode("--enable-dbo", "auto") == "auto"
    assert mode("--enable-dbo", "off") == "off"
    args = parser.parse_args(["--dbo-decode-token-threshold", "64"])
    assert (args.dbo_decode_token_threshold, args.dbo_prefill_token_threshold) == (64, 512)
    assert (dbo_mode(True), dbo_mode(False)) == ("on", "off")  # LLM(enable_dbo=True)
    with pytest.raises(ValueError, match="enable_dbo needs --enable-expert-parallel"):
        ParallelConfig(data_parallel_size=2, enable_dbo="on")
    with pytest.raises(ValueError, match="enable_dbo must be one of"):
        ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, enable_dbo="yes")
    with pytest.raises(ValueError, match="dbo_decode_token_threshold must be >= 2"):
        ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, enable_dbo="on",
                       dbo_decode_token_threshold=1)
