"""The analytic cost model: hand-checked ops, the lockstep rule (imbalance costs every rank),
DBO (hides communication at large batches, costs at tiny ones), launch overhead, KV transfer."""

import dataclasses

import pytest

from tests.sim.sim_configs import DEEPSEEK_V3, DEEPSEEK_V3_SMALL, LLAMA3_8B
from widellm.sim import links
from widellm.sim.cost_model import (
    BREAKDOWN_KEYS, KERNELS_PER_LAYER, KERNELS_PER_STEP, kv_transfer_time, make_cost_model,
)
from widellm.sim.hardware import H100, H200, HardwareProfile
from widellm.sim.types import DeploymentShape, RankStepLoad

ROUND = HardwareProfile(
    name="round", peak_flops_bf16=1e12, peak_flops_fp8=2e12, mem_bandwidth=1e11,
    memory_bytes=1e10, nvlink_bandwidth=100e9, nvlink_latency_s=1e-6,
    internode_bandwidth=10e9, internode_latency_s=10e-6, gpus_per_node=8,
    gemm_plateau_eff=0.5, gemm_half_m=0.0, gemm_mem_eff=1.0,
    attn_compute_eff=0.5, attn_mem_eff=1.0, launch_eager_s=1e-6, launch_graph_s=0.0,
)


def decode_loads(cfg, seqs, ctx, num_ranks, ranks_per_node=8, hot_factor=1.0):
    """Uniform decode loads (rank 0's experts get ``hot_factor`` times the rows)."""
    top_k, experts = cfg["num_experts_per_tok"], cfg["n_routed_experts"]
    copies = seqs * top_k
    _, intra, inter = links.uniform_copies_split(copies, num_ranks, ranks_per_node)
    out = []
    for r in range(num_ranks):
        recv = copies * (hot_factor if r == 0 else 1.0)
        out.append(RankStepLoad(
            num_tokens=seqs, num_decode_tokens=seqs, num_seqs=seqs,
            attn_kv_read_tokens=seqs * ctx, attn_score_pairs=seqs * ctx,
            expert_recv_tokens=recv, max_expert_tokens=recv / (experts / num_ranks),
            active_local_experts=experts // num_ranks, sent_intra_node=intra,
            sent_inter_node=inter))
    return out


def test_gemm_roofline_by_hand():
    m = make_cost_model(LLAMA3_8B, ROUND, DeploymentShape(num_ranks=1), weight_dtype="bf16")
    # 1000 rows x 1e6 weights: 2e9 FLOPs at 1e12 * 0.5 = 4 ms (weights: 2 MB at 100 GB/s).
    assert m.gemm_time(1000, 1e6, "bf16") == pytest.approx(4e-3)
    # One row x 1e9 FP8 weights: memory-bound, 1 GB at 100 GB/s = 10 ms.
    assert m.gemm_time(1, 1e9, "fp8") == pytest.approx(1e-2)
    assert m.gemm_time(0, 1e9, "fp8") == 0.0


def test_attention_by_hand():
    m = make_cost_model(DEEPSEEK_V3_SMALL, ROUND, DeploymentShape(num_ranks=1))
    per_pair = 2 * 16 * 576 + 2 * 16 * 512
    # 1e6 pairs: 34.8 GFLOP at 0.5 TFLOP/s = 69.6 ms; KV 1e6 x 576 x 2 B at 100 GB/s = 11.5 ms.
    assert m.attention_time(1e6, 1e6, per_pair) == pytest.approx(1e6 * per_pair / 0.5e12)
    assert m.attention_time(0, 1e6, per_pair) == pytest.approx(1e6 * 1152 / 1e11)


def test_dense_single_rank_step_by_hand():
    cfg = dict(LLAMA3_8B, num_hidden_layers=2)
    m = make_cost_model(cfg, ROUND, DeploymentShape(num_ranks=1, cuda_graphs=False),
                        weight_dtype="bf16")
    load = RankStepLoad(num_tokens=1000, num_prefill_tokens=1000, num_seqs=1,
                        attn_score_pairs=500_500, attn_kv_read_tokens=0)
    attn_proj = 4096 * 48 * 128 + 4096 * 4096
    mlp = 3 * 4096 * 14336
    gemm = 2 * (2 * 1000 * (attn_proj + mlp) / 0.5e12)  # compute-bound at 1000 rows
    attention = 2 * (500_500 * 4 * 32 * 128 / 0.5e12)
    lm_head = max(2 * 4096 * 128256 / 0.5e12, 4096 * 128256 * 2 / 1e11)  # one sampled row
    # Elementwise passes: 10 H-wide (norms, residuals) + 3 I-wide (SiLU-and-mul) per row and
    # layer, bf16, at 100 GB/s.
    elementwise = 2 * 1000 * (10 * 4096 + 3 * 14336) * 2 / 1e11
    device = gemm + attention + lm_head + elementwise
    kernels = 2 * (KERNELS_PER_LAYER["attention"] + KERNELS_PER_LAYER["dense_mlp"]) \
        + KERNELS_PER_STEP
    launch = max(0.0, kernels * 1e-6 - device)  # hidden behind the device time
    [cost] = m.step([load], split=False)
    assert cost.total_s == pytest.approx(device + launch)
    assert cost.breakdown["dispatch"] == cost.breakdown["combine"] == 0.0
    assert cost.breakdown["elementwise"] == pytest.approx(elementwise)
    assert cost.breakdown["wait"] == pytest.approx(0.0, abs=1e-12)
    assert set(cost.breakdown) == set(BREAKDOWN_KEYS)


def test_imbalance_raises_every_ranks_step_time():
    dep = DeploymentShape(num_ranks=16, all2all_backend="all2all_fixed")
    m = make_cost_model(DEEPSEEK_V3, H100, dep)
    even = m.step(decode_loads(DEEPSEEK_V3, 128, 2000, 16), split=False)
    skew = m.step(decode_loads(DEEPSEEK_V3, 128, 2000, 16, hot_factor=2.0), split=False)
    assert len({c.total_s for c in even}) == 1 and len({c.total_s for c in skew}) == 1
    assert skew[5].total_s > even[5].total_s  # rank 5 is not the hot one, and still pays
    # The cold ranks wait for the hot one. At 64 rows per expert its GEMMs are still bound
    # by the weight read (no slower); at 4x they are compute-bound and slower.
    assert skew[5].breakdown["wait"] > even[5].breakdown["wait"]
    assert skew[0].breakdown["expert_gemm"] >= skew[5].breakdown["expert_gemm"]
    hot = m.step(decode_loads(DEEPSEEK_V3, 128, 2000, 16, hot_factor=4.0), split=False)
    assert hot[0].breakdown["expert_gemm"] > hot[5].breakdown["expert_gemm"]
    assert hot[5].total_s > skew[5].total_s


def test_dbo_hides_comm_at_large_batch_and_costs_at_tiny_batch():
    dep = DeploymentShape(num_ranks=32, all2all_backend="all2all_fixed")
    m = make_cost_model(DEEPSEEK_V3, H200, dep)
    big = decode_loads(DEEPSEEK_V3, 256, 3000, 32)
    plain, split = m.step(big, split=False)[0], m.step(big, split=True)[0]
    assert split.total_s < plain.total_s
    assert split.breakdown["hidden_comm"] > 0 and plain.breakdown["hidden_comm"] == 0
    for c in (plain, split):
        assert c.breakdown["exposed_comm"] + c.breakdown["hidden_comm"] == pytest.approx(
            c.breakdown["dispatch"] + c.breakdown["combine"])
    tiny = decode_loads(DEEPSEEK_V3, 2, 100, 32)
    assert m.step(tiny, split=True)[0].total_s > m.step(tiny, split=False)[0].total_s


def test_cuda_graphs_cut_launch_overhead_in_decode():
    # A small model at 4 sequences on one GPU: the device time is below the eager host launch
    # time.
    cfg = DEEPSEEK_V3_SMALL
    loads = decode_loads(cfg, 4, 100, 1)
    graphs = make_cost_model(cfg, H100, DeploymentShape(num_ranks=1, cuda_graphs=True))
    eager = make_cost_model(cfg, H100, DeploymentShape(num_ranks=1, cuda_graphs=False))
    g, e = graphs.step(loads, split=False)[0], eager.step(loads, split=False)[0]
    assert g.breakdown["launch"] < e.breakdown["launch"] and g.total_s < e.total_s


def test_all2all_modes_and_single_rank():
    loads = decode_loads(DEEPSEEK_V3, 64, 1000, 16)
    ll = make_cost_model(DEEPSEEK_V3, H100, DeploymentShape(16, all2all_backend="all2all_fixed"))
    ag = make_cost_model(DEEPSEEK_V3, H100,
                         DeploymentShape(16, all2all_backend="allgather_reducescatter"))
    # Every rank receiving every rank's tokens costs more than routed copies only.
    assert ag.step(loads, False)[0].breakdown["dispatch"] > \
        ll.step(loads, False)[0].breakdown["dispatch"]
    one = make_cost_model(DEEPSEEK_V3_SMALL, H100, DeploymentShape(1))
    [c] = one.step([RankStepLoad(num_tokens=8, num_decode_tokens=8, num_seqs=8,
                                 attn_kv_read_tokens=800, attn_score_pairs=800)], False)
    assert c.breakdown["dispatch"] == 0.0 and c.breakdown["expert_gemm"] > 0


def test_shared_cpu_host_splits_compute():
    cpu = dataclasses.replace(ROUND, name="cpuish", ranks_share_host=True, async_launch=False)
    load = RankStepLoad(num_tokens=256, num_decode_tokens=256, num_seqs=256,
                        attn_kv_read_tokens=25600, attn_score_pairs=25600)
    one = make_cost_model(LLAMA3_8B, cpu, DeploymentShape(1, ranks_per_node=2), "bf16")
    two = make_cost_model(LLAMA3_8B, cpu, DeploymentShape(2, ranks_per_node=2), "bf16")
    t1 = one.step([load], False)[0]
    t2 = two.step([load, load], False)[0]
    kernels = 32 * 20 + KERNELS_PER_STEP
    assert t1.breakdown["launch"] == pytest.approx(kernels * 1e-6)  # synchronous on CPU
    assert t2.total_s - t2.breakdown["launch"] == pytest.approx(
        2 * (t1.total_s - t1.breakdown["launch"]))


def test_kv_transfer_time_by_hand():
    t = kv_transfer_time(1000, DEEPSEEK_V3, H100, inter_node=True)
    assert t == pytest.approx(H100.internode_latency_s + 1000 * 70272 / 50e9)
    assert kv_transfer_time(1000, DEEPSEEK_V3, H100, inter_node=False) < t


def test_bad_dtype_rejected():
    with pytest.raises(ValueError):
        make_cost_model(DEEPSEEK_V3, H100, DeploymentShape(8), weight_dtype="int3")


def test_fixed_capacity_blocks_are_sized_per_step():
    """Where the fixed exchange moves whole blocks (gloo), an eager step's block holds its
    largest rank's tokens rounded up to a power of two, times min(top_k, experts per rank):
    20 decode tokens per rank of DeepSeek-V3-small (top-6) at EP2 move 32 x 6 rows per rank
    pair, as a buffer of that capacity would; 256 tokens fill the default 256 x 6 = 1,536-row
    buffer, which a step under CUDA graphs always moves."""
    full_buffer = dataclasses.replace(ROUND, fixed_a2a_full_buffer=True)

    def dispatch_s(capacity, seqs, graphs=False):
        dep = DeploymentShape(2, ranks_per_node=2, all2all_backend="all2all_fixed",
                              cuda_graphs=graphs, max_num_seqs=256)
        model = make_cost_model(DEEPSEEK_V3_SMALL, full_buffer, dep,
                                all2all_fixed_capacity=capacity)
        return model.step(decode_loads(DEEPSEEK_V3_SMALL, seqs, 100, 2, 2), False)[0] \
            .breakdown["dispatch"]

    assert dispatch_s(1536, 20) == pytest.approx(dispatch_s(32 * 6, 20))
    assert dispatch_s(1536, 20) == pytest.approx(dispatch_s(1536, 32))
    assert dispatch_s(1536, 20) < dispatch_s(1536, 33)
    assert dispatch_s(1536, 256) == pytest.approx(dispatch_s(1536, 300))
    assert dispatch_s(None, 20) == pytest.approx(dispatch_s(1536, 20))  # the default capacity
    assert dispatch_s(None, 20, graphs=True) == pytest.approx(dispatch_s(1536, 256))
