"""Hardware profiles: datasheet numbers, the efficiency curve, loading by name and from JSON."""

import dataclasses
import json
import math

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


def test_op_time_is_max_when_overlapped_and_sum_when_not():
    assert H100.op_time(2.0, 3.0) == 3.0  # GPUs stream weights while they compute
    assert dataclasses.replace(H100, roofline_overlap=0.0).op_time(2.0, 3.0) == 5.0
    assert dataclasses.replace(H100, roofline_overlap=0.5).op_time(2.0, 3.0) == 4.0
    with pytest.raises(ValueError):
        dataclasses.replace(H100, roofline_overlap=1.5)


def test_expert_curve_interpolates_and_extends():
    p = dataclasses.replace(H100, expert_curve=[[1.0, 2.0], [3.0, 4.0], [10.0, 20.0]])
    assert p.expert_curve == ((1.0, 2.0), (3.0, 4.0), (10.0, 20.0))  # JSON lists -> tuples
    assert p.expert_seconds_per_byte(2.0) == 3.0  # halfway between the first two points
    assert p.expert_seconds_per_byte(20.0) == 40.0  # past the last: in proportion to rows
    # Below the first point: the share of experts hit, 1 - exp(-rows), relative to the first's.
    assert p.expert_seconds_per_byte(0.5) == pytest.approx(
        2.0 * (1 - math.exp(-0.5)) / (1 - math.exp(-1.0)))


def test_shared_host_splits_the_machine():
    cpu = dataclasses.replace(
        H100, ranks_share_host=True, gpus_per_node=2, peak_flops_fp32=8e12,
        expert_curve=((1.0, 2.0),), core_expert_curve=((1.0, 3.0),), core_mem_bandwidth=1e12,
        core_peak_flops_fp32=3e12)
    half = cpu.shared_by(2)  # one core each: the figures timed next to a busy neighbour
    assert (half.mem_bandwidth, half.peak_flops_fp32) == (1e12, 3e12)
    assert half.peak_flops_bf16 == H100.peak_flops_bf16 / 2
    assert half.expert_curve == ((1.0, 3.0),)
    wide = dataclasses.replace(cpu, gpus_per_node=8).shared_by(2)  # 4 cores each
    assert wide.expert_curve == ((1.0, 4.0),)
    assert (wide.mem_bandwidth, wide.peak_flops_fp32) == (H100.mem_bandwidth / 2, 4e12)
    assert cpu.shared_by(1) is cpu


def test_two_point_kernel_fit_by_hand():
    from widellm.sim.profiles.measure_kernels import fit_two_points

    # 100 bytes; 10 FLOPs in 2 s and 110 FLOPs in 3 s: 100 FLOPs per s, so the first call read
    # its weights in 2 - 0.1 = 1.9 s.
    fit = fit_two_points(100.0, (10.0, 110.0), (2.0, 3.0))
    assert fit.flops_rate == pytest.approx(100.0)
    assert fit.bandwidth == pytest.approx(100.0 / 1.9)
