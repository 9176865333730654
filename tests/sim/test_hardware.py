"""Hardware profiles: datasheet numbers, the efficiency curve, loading by name and from JSON."""

import dataclasses
import json

import pytest

from widellm.sim.hardware import (
    B200, GPU_PROFILES, H100, H200, PROFILES, HardwareProfile, load_profile, profile_from_json,
)


def test_datasheet_numbers():
    assert H100.peak_flops_bf16 == 989e12 and H100.peak_flops_fp8 == 1979e12
    assert H100.mem_bandwidth == 3.35e12 and H100.memory_bytes == 80e9
    assert H200.mem_bandwidth == 4.8e12 and H200.memory_bytes == 141e9
    assert H200.peak_flops_fp8 == H100.peak_flops_fp8  # same GH100 compute
    assert B200.peak_flops_fp8 == 4.5e15 and B200.mem_bandwidth == 8e12
    for p in (H100, H200, B200):
        assert p.gpus_per_node == 8 and p.internode_bandwidth == 50e9


def test_gemm_efficiency_curve_matches_deepgemm_masked_table():
    # DeepGEMM README (H800, FP8), masked grouped GEMMs: 932 / 1040 / 1233 TFLOPS at 256 /
    # 512 / 1024 rows per group; the curve is within 12% of each.
    for rows, tflops in ((256, 932), (512, 1040), (1024, 1233), (4096, 1304)):
        achieved = H100.gemm_efficiency(rows) * H100.peak_flops_fp8 / 1e12
        assert achieved == pytest.approx(tflops, rel=0.12)
    assert H100.gemm_efficiency(1) < H100.gemm_efficiency(64) < H100.gemm_efficiency(4096)
    assert H100.gemm_efficiency(1e9) == pytest.approx(H100.gemm_plateau_eff, rel=1e-6)


def test_peak_by_dtype():
    assert H100.peak_flops("fp8") == 1979e12 and H100.peak_flops("bf16") == 989e12
    no_fp8 = dataclasses.replace(H100, peak_flops_fp8=0.0)
    assert no_fp8.peak_flops("fp8") == 989e12


def test_load_by_name_and_json(tmp_path):
    assert load_profile("H200") is H200
    assert set(GPU_PROFILES) <= set(PROFILES)
    path = tmp_path / "p.json"
    data = dict(H100.to_json_dict(), name="mine", unknown_future_field=1)
    path.write_text(json.dumps(data))
    loaded = load_profile(str(path))
    assert loaded == dataclasses.replace(H100, name="mine")
    assert profile_from_json(H200.to_json_dict()) == H200
    with pytest.raises(ValueError):
        load_profile("tpu-v9")


def test_committed_cpu_profile_loads():
    cpu = PROFILES["cpu"]
    assert cpu.name == "cpu" and cpu.ranks_share_host and not cpu.async_launch
    assert cpu.peak_flops_bf16 > 1e9 and cpu.mem_bandwidth > 1e9
    assert "measured" in cpu.source


def test_validation():
    with pytest.raises(ValueError):
        dataclasses.replace(H100, gemm_mem_eff=1.5)
    with pytest.raises(ValueError):
        dataclasses.replace(H100, mem_bandwidth=0)
    assert isinstance(H100, HardwareProfile)


def test_fit_half_m_recovers_a_synthetic_curve():
    from widellm.sim.profiles.measure_cpu import _fit_half_m

    curve = {m: 1e12 * m / (m + 32) for m in (1, 8, 32, 128, 512, 2048)}
    peak, half_m = _fit_half_m(curve)
    assert half_m == 32 and peak == pytest.approx(1e12)
