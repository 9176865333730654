"""The all-to-all link model against DeepEP's published tables (legacy README, H800 + CX7),
and its hand-checkable pieces."""

import pytest

from widellm.sim import links
from widellm.sim.hardware import H800, HardwareProfile

# Tolerances of the reproductions. The model has one fixed latency per op (the median residual
# over EP16-EP256) and the link's bandwidth; multi-node points, where RDMA is the bottleneck,
# land within 11%; at EP8 (one node, NVLink) the combine is over-estimated by ~24%.
LL_MULTI_NODE_TOL = 0.11
LL_ANY_TOL = 0.25
NORMAL_TOL = 0.20


@pytest.mark.parametrize("ep", sorted(links.DEEPEP_LL_TABLE))
def test_low_latency_table_reproduced(ep):
    dispatch_us, _, combine_us, _ = links.DEEPEP_LL_TABLE[ep]
    d, c = links.deepep_low_latency(H800, ep)
    tol = LL_MULTI_NODE_TOL if ep > H800.gpus_per_node else LL_ANY_TOL
    assert d * 1e6 == pytest.approx(dispatch_us, rel=tol)
    assert c * 1e6 == pytest.approx(combine_us, rel=tol)


def test_low_latency_reported_bandwidth_is_copies_over_time():
    # DeepEP's GB/s column is all (token, expert) copies' bytes over the latency: FP8 rows of
    # 7168 + 7168/128*4 bytes. At EP8: 128*8*7392 B / 77 us = 98 GB/s, the published figure.
    row = links.dispatch_row_bytes(H800, 7168, 2)
    assert row == 7168 + 56 * 4
    assert 128 * 8 * row / 77e-6 / 1e9 == pytest.approx(98, abs=0.5)


@pytest.mark.parametrize("ep", sorted(links.DEEPEP_NORMAL_TABLE))
def test_normal_table_reproduced(ep):
    d_pub, c_pub = links.DEEPEP_NORMAL_TABLE[ep]
    d, c = links.deepep_normal_bandwidth(H800, ep)
    assert d == pytest.approx(d_pub, rel=NORMAL_TOL)
    assert c == pytest.approx(c_pub, rel=NORMAL_TOL)


def _round_profile() -> HardwareProfile:
    return HardwareProfile(
        name="round", peak_flops_bf16=1e12, peak_flops_fp8=2e12, mem_bandwidth=1e11,
        memory_bytes=1e10, nvlink_bandwidth=100e9, nvlink_latency_s=1e-6,
        internode_bandwidth=10e9, internode_latency_s=10e-6, gpus_per_node=4,
        a2a_nvlink_eff=1.0, a2a_rdma_eff=1.0,
        a2a_dispatch_latency_s=20e-6, a2a_combine_latency_s=30e-6)


def test_all_to_all_time_by_hand():
    p = _round_profile()
    # Intra 1 MB at 100 GB/s = 10 us; inter 1 MB at 10 GB/s = 100 us; links run concurrently.
    assert links.all_to_all_time(p, 1e6, 1e6, "dispatch", 8) == pytest.approx(20e-6 + 100e-6)
    assert links.all_to_all_time(p, 1e6, 0, "combine", 8) == pytest.approx(30e-6 + 10e-6)
    assert links.all_to_all_time(p, 1e6, 1e6, "dispatch", 1) == 0.0


def test_allgather_and_point_to_point_by_hand():
    p = _round_profile()
    # 4 ranks in one node: 3 ring steps of (1 us + 1 MB / 100 GB/s).
    assert links.allgather_time(p, 1e6, 4, 4) == pytest.approx(3 * (1e-6 + 10e-6))
    # 8 ranks over 2 nodes: the ring crosses the NIC: 7 x (10 us + 100 us).
    assert links.allgather_time(p, 1e6, 8, 4) == pytest.approx(7 * (10e-6 + 100e-6))
    assert links.point_to_point_time(p, 1e9, inter_node=True) == pytest.approx(10e-6 + 0.1)


def test_node_dedup_factor():
    assert links.node_dedup_factor(8, 1) == 1.0
    assert links.node_dedup_factor(1, 4) == 1.0
    # 2 nodes, top-8: a token reaches 2 (1 - 2^-8) nodes; over 8 copies.
    assert links.node_dedup_factor(8, 2) == pytest.approx(2 * (1 - 0.5**8) / 8)
    # The routing's node limit caps the nodes a token can reach.
    assert links.node_dedup_factor(8, 8, node_limit=4) == links.node_dedup_factor(8, 4)


def test_backend_modes():
    assert links.backend_mode("all2all_fixed", 8, decode_only=False) == links.LOW_LATENCY
    assert links.backend_mode("all2all", 8, decode_only=True) == links.NORMAL
    assert links.backend_mode("auto", 8, decode_only=True) == links.LOW_LATENCY
    assert links.backend_mode("auto", 8, decode_only=False) == links.NORMAL
    assert links.backend_mode("all2all", 1, decode_only=False) == links.LOCAL
    with pytest.raises(ValueError):
        links.backend_mode("nccl", 8, decode_only=True)
