"""Hardware profiles for the simulator's cost model: what one rank (a GPU, or one CPU rank) can
do, and the links between ranks.

Every number is per GPU unless said otherwise; bandwidths are bytes/s in one direction.

Constants and their sources
===========================

| constant | H100 SXM | H200 SXM | B200 (HGX/DGX) | source |
|---|---|---|---|---|
| dense BF16 tensor FLOP/s | 989e12 | 989e12 | 2.25e15 | NVIDIA H100 / H200 datasheets (1,979 TFLOPS *with sparsity*, halved); DGX B200 datasheet (72 PFLOPS FP8 sparse per 8 GPUs; BF16 half of FP8) |
| dense FP8 tensor FLOP/s | 1979e12 | 1979e12 | 4.5e15 | same datasheets (3,958 TFLOPS sparse for H100/H200; DGX B200 72 PF sparse / 8 / 2) |
| HBM bandwidth | 3.35e12 | 4.8e12 | 8.0e12 | H100 datasheet (HBM3 3.35 TB/s), H200 datasheet (HBM3e 4.8 TB/s), DGX B200 (64 TB/s / 8) |
| memory | 80 GB | 141 GB | 180 GB | same datasheets (DGX B200 1,440 GB / 8) |
| NVLink per direction | 450e9 | 450e9 | 900e9 | NVLink 4: 900 GB/s bidirectional per GPU; NVLink 5: 1.8 TB/s (datasheets) |
| inter-node per GPU | 50e9 | 50e9 | 50e9 | one ConnectX-7 400 Gb/s NIC per GPU (DGX H100/H200/B200); DeepEP legacy README: "CX7 InfiniBand 400 Gb/s RDMA network card (~50 GB/s maximum bandwidth)" |
| GPUs per node | 8 | 8 | 8 | HGX/DGX baseboards |

Measured efficiencies (what fraction of a peak real kernels reach), all from published
measurements on Hopper (H800 SXM5: the H100's compute and HBM, a cut-down NVLink):

* GEMM compute efficiency as a function of rows M: ``eff(M) = GEMM_PLATEAU * M / (M +
  GEMM_HALF_M)`` with plateau 0.70 and half point 128 rows, the least-squares shape of
  DeepGEMM's README tables (FP8, H800): masked grouped GEMM 932 / 1,040 / 1,233 TFLOPS at 256 /
  512 / 1,024 rows per expert (0.47 / 0.53 / 0.62 of 1,979), dense GEMMs 1,304-1,358 TFLOPS at
  4,096 rows (0.66-0.69). Below ~256 rows those kernels are bound by the weight read, which the
  roofline's memory term (below) prices.
* GEMM memory efficiency 0.80: DeepGEMM's small-M (64 and 128 row) GEMMs stream weights at
  2,103-2,668 GB/s of H800's 3.35 TB/s.
* Attention: FlashMLA README (H800 SXM5): "up to 3000 GB/s in memory-bound configuration"
  (0.90 of HBM) and 660 TFLOPS compute-bound (2025-04-22 update; 0.67 of 989 BF16).
* All-to-all link efficiency: DeepEP legacy README, normal kernels on H800: 153 / 158 GB/s
  dispatch / combine over NVLink "~160 GB/s maximum" (0.96); 43-58 GB/s over RDMA of ~50 GB/s
  (taken as 1.0: the NIC is saturated). H100/H200 apply the NVLink fraction to their own
  450 GB/s, an extrapolation: DeepEP publishes no H100 intranode figure.
* All-to-all fixed latencies (one dispatch or combine, besides the bytes): the residual of
  DeepEP's low-latency table (H800, 128 tokens, hidden 7,168, top-8, FP8 dispatch, BF16
  combine, EP16-EP256) after subtracting bytes / 50 GB/s: dispatch 40-50 us (median 42), combine
  48-94 us (median 57). ``links.py`` reproduces the table from these (its tests).
* Communication SMs: DeepEP's normal kernels run on their own SMs (the README's example sets 24
  of H800's 132); while they overlap compute (DBO in prefill) the GEMMs get the rest.
  Low-latency kernels occupy no SM while waiting (DeepEP: "hook-based ... without occupying any
  SM resource").
* All-to-all inside the running pipeline: slower than DeepEP's unit tests. SGLang's kernel
  breakdown (LMSYS blog, 2025-05-05, "Profile Results") reads ~0.17 ms per decode dispatch in
  both DeepSeek's profile and its own against 0.06 ms in DeepEP's unit test, and prefill
  communication slower than the unit tests in both. ``A2A_IN_PIPELINE_FACTOR`` scales the
  link model's all-to-all (dispatch and combine; not the allgather backend's NCCL
  collectives, which nothing here measured) by one factor fitted to DeepSeek's own published
  profile (the same blog's table, from github.com/deepseek-ai/profile-data: H800, balanced
  routing, two micro-batches;
  decode EP128, 128 requests per GPU at 4,096 KV tokens, 18,598 tok/s per node; prefill EP32,
  16,384 tokens per GPU of 4,096-token prompts, 62,713 tok/s per node): the geometric mean of
  the factors that reproduce each phase exactly (1.29 and 1.62). ``tests/sim/test_published.py``
  re-derives it; the SGLang and vLLM figures it is then checked against are not used.
* Kernel launch: ~5 us per kernel on the host through the CUDA driver and runtime (pegainfer's
  launch-overhead measurement, 4-6 us); a CUDA graph replays its kernels back to back, ~0.5 us
  apart (NVIDIA, "Getting Started with CUDA Graphs": 3.4 us per 2.9 us kernel in a graph).
  The kernel count per layer is the cost model's (``cost_model.KERNELS_PER_LAYER``).

The B200's efficiencies are Hopper's (no published DeepGEMM/FlashMLA tables for SM100 at the
time of writing); its NVLink efficiency is DeepEP V2's SM100 EP8 result: 726 / 740 GB/s
dispatch / combine of 900 GB/s (0.81).

The CPU profile ("cpu") is measured on the machine that runs the engine:
``widellm/sim/profiles/cpu.json``, written by ``benchmarks/sim_cpu_profile.py`` (or
:func:`widellm.sim.profiles.measure_cpu.measure_cpu_profile`); its ``source`` field names the
machine and date.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

GB = 1e9
TB = 1e12
US = 1e-6

# --- measured efficiencies (sources in the module docstring) ---
DEEPGEMM_PLATEAU_EFF = 0.70
DEEPGEMM_HALF_M = 128.0
DEEPGEMM_MEM_EFF = 0.80
FLASHMLA_MEM_EFF = 3000 / 3350
FLASHMLA_COMPUTE_EFF = 660 / 989
DEEPEP_NVLINK_EFF_H800 = 153 / 160
DEEPEP_NVLINK_EFF_SM100 = 726 / 900
DEEPEP_RDMA_EFF = 1.0
DEEPEP_LL_DISPATCH_LATENCY_S = 42 * US
DEEPEP_LL_COMBINE_LATENCY_S = 57 * US
DEEPEP_NORMAL_SMS = 24
A2A_IN_PIPELINE_FACTOR = 1.45
HOPPER_SMS = 132
# B200: two dies of 74 enabled SMs (as reported for the HGX B200; NVIDIA publishes no SM count
# in the datasheet). Only the DBO slowdown from communication SMs uses it.
B200_SMS = 148
CUDA_LAUNCH_EAGER_S = 5 * US
CUDA_GRAPH_KERNEL_GAP_S = 0.5 * US
# NVLink latency: one NVSwitch hop; no published per-transfer figure for the all-to-all itself,
# so the link term uses DeepEP's measured fixed latencies above and this only prices point-to-
# point transfers (KV transfer): NVIDIA quotes sub-microsecond switch latency; 2 us covers
# the software around a put.
NVLINK_LATENCY_S = 2 * US
# InfiniBand NDR end to end through one switch: ~2-3 us for small RDMA writes (NVIDIA
# ConnectX-7 / Quantum-2 product briefs quote sub-microsecond switch port-to-port latency);
# 5 us covers the verbs software around a transfer.
IB_LATENCY_S = 5 * US


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One rank's hardware (see the module docstring for every number's source).

    Attributes:
        name: profile name.
        peak_flops_bf16: dense BF16 matmul FLOP/s (the CPU profile: measured bf16 matmul peak).
        peak_flops_fp8: dense FP8 FLOP/s; 0 where the device has no FP8 units (FP8 weights are
            then dequantized and multiplied at the BF16 rate).
        peak_flops_fp32: dense FP32 matmul FLOP/s (CPU; on GPUs TF32 is not used by the engine).
        mem_bandwidth: HBM (or DRAM) bytes/s.
        memory_bytes: device memory.
        nvlink_bandwidth: intra-node link bytes/s per direction per rank.
        nvlink_latency_s: one intra-node point-to-point transfer's fixed cost.
        internode_bandwidth: inter-node bytes/s per rank (its NIC).
        internode_latency_s: one inter-node point-to-point transfer's fixed cost.
        gpus_per_node: ranks per node.
        num_sms: streaming multiprocessors (0 on CPU).
        gemm_plateau_eff, gemm_half_m: GEMM compute efficiency ``plateau * M / (M + half_m)``.
        gemm_mem_eff: fraction of ``mem_bandwidth`` a GEMM's weight read reaches.
        attn_compute_eff, attn_mem_eff: the same for attention kernels.
        a2a_nvlink_eff, a2a_rdma_eff: fraction of link bandwidth an all-to-all reaches.
        a2a_dispatch_latency_s, a2a_combine_latency_s: fixed cost of one dispatch / combine.
        comm_sms_normal: SMs the normal-mode all-to-all kernels occupy while they run.
        a2a_in_pipeline_factor: how much longer an all-to-all takes inside a running step
            than the link model's unit-test figures (1 on CPU, where gloo's exchange is
            measured between busy ranks; the GPU profiles: ``A2A_IN_PIPELINE_FACTOR``).
        dispatch_fp8: dispatch sends FP8 rows with per-128 scales (DeepEP); else activations.
        launch_eager_s: host cost per kernel (per op on CPU) without graphs.
        launch_graph_s: cost per kernel in a replayed CUDA graph.
        async_launch: the host launches ahead of the device (GPUs), so eager launch costs only
            what it exceeds the device time by; False on CPU, where each op's overhead adds.
        ranks_share_host: ranks of one node share its compute and memory bandwidth (CPU ranks
            on one machine); the cost model divides peaks by the ranks per node.
        fixed_a2a_full_buffer: the fixed-capacity all-to-all moves its whole buffer (widellm's
            gloo ``all2all_fixed``) instead of only the rows used (DeepEP low-latency).
        step_overhead_s: host work per engine step outside the forward (scheduling, sampling,
            output processing) that the device does not hide (0 on GPUs: async scheduling).
        step_overhead_per_seq_s: the same, per sequence of the step (the busiest rank's).
        roofline_overlap: how far an op's compute and weight read overlap: 1 prices an op at
            ``max(compute, memory)`` (GPU kernels stream weights while they compute), 0 at their
            sum (the CPU profile: its timings of the engine's own kernels fit a sum).
        expert_curve: the routed-expert kernel measured on this machine (CPU profile):
            ``((mean rows per expert, seconds per byte of the experts' weights), ...)``, rows
            ascending; empty (GPUs) prices experts by the GEMM roofline.
        core_peak_flops_fp32, core_mem_bandwidth, core_expert_curve: one rank on one core
            while another process keeps the next core busy (the CPU profile: timed on one
            thread next to a busy neighbour), used once ranks split the machine's cores one
            each; 0 / empty: a ``k``-th of the whole machine's figures.
        source: where the numbers come from (machine and date for measured profiles).
    """

    name: str
    peak_flops_bf16: float
    peak_flops_fp8: float
    mem_bandwidth: float
    memory_bytes: float
    nvlink_bandwidth: float
    nvlink_latency_s: float
    internode_bandwidth: float
    internode_latency_s: float
    gpus_per_node: int = 8
    peak_flops_fp32: float = 0.0
    num_sms: int = HOPPER_SMS
    gemm_plateau_eff: float = DEEPGEMM_PLATEAU_EFF
    gemm_half_m: float = DEEPGEMM_HALF_M
    gemm_mem_eff: float = DEEPGEMM_MEM_EFF
    attn_compute_eff: float = FLASHMLA_COMPUTE_EFF
    attn_mem_eff: float = FLASHMLA_MEM_EFF
    a2a_nvlink_eff: float = DEEPEP_NVLINK_EFF_H800
    a2a_rdma_eff: float = DEEPEP_RDMA_EFF
    a2a_dispatch_latency_s: float = DEEPEP_LL_DISPATCH_LATENCY_S
    a2a_combine_latency_s: float = DEEPEP_LL_COMBINE_LATENCY_S
    comm_sms_normal: int = DEEPEP_NORMAL_SMS
    a2a_in_pipeline_factor: float = 1.0
    dispatch_fp8: bool = True
    launch_eager_s: float = CUDA_LAUNCH_EAGER_S
    launch_graph_s: float = CUDA_GRAPH_KERNEL_GAP_S
    async_launch: bool = True
    ranks_share_host: bool = False
    fixed_a2a_full_buffer: bool = False
    step_overhead_s: float = 0.0
    step_overhead_per_seq_s: float = 0.0
    roofline_overlap: float = 1.0
    expert_curve: tuple[tuple[float, float], ...] = ()
    core_peak_flops_fp32: float = 0.0
    core_mem_bandwidth: float = 0.0
    core_expert_curve: tuple[tuple[float, float], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("peak_flops_bf16", "mem_bandwidth", "nvlink_bandwidth",
                     "internode_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        for name in ("gemm_plateau_eff", "gemm_mem_eff", "attn_compute_eff", "attn_mem_eff",
                     "a2a_nvlink_eff", "a2a_rdma_eff"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if not 0 <= self.roofline_overlap <= 1:
            raise ValueError(f"roofline_overlap must be in [0, 1], got {self.roofline_overlap}")
        # JSON gives lists; keep the frozen profile hashable and comparable.
        for name in ("expert_curve", "core_expert_curve"):
            object.__setattr__(self, name,
                               tuple((float(r), float(t)) for r, t in getattr(self, name)))

    def op_time(self, compute_s: float, memory_s: float) -> float:
        """An op's seconds from its compute and memory times (see ``roofline_overlap``)."""
        return (max(compute_s, memory_s)
                + (1.0 - self.roofline_overlap) * min(compute_s, memory_s))

    def expert_seconds_per_byte(self, rows_per_expert: float) -> float:
        """``expert_curve`` at ``rows_per_expert``: linear between its points; below the first,
        in proportion to the share of experts that get a row under uniform routing
        (``1 - exp(-rows per expert)``: an idle expert's weights are not read); past the last,
        in proportion to the rows (compute bound)."""
        curve = self.expert_curve
        if rows_per_expert <= curve[0][0]:
            first_rows, first_t = curve[0]
            return first_t * (-math.expm1(-rows_per_expert)) / (-math.expm1(-first_rows))
        for (r0, t0), (r1, t1) in zip(curve, curve[1:]):
            if rows_per_expert <= r1:
                return t0 + (t1 - t0) * (rows_per_expert - r0) / (r1 - r0)
        last_rows, last_t = curve[-1]
        return last_t * rows_per_expert / last_rows

    def shared_by(self, k: int) -> "HardwareProfile":
        """One rank's profile when ``k`` ranks share this host (``ranks_share_host``): the
        ``core_*`` figures once each rank has one core, else a ``k``-th of the machine."""
        if k <= 1:
            return self
        one_core = k >= self.gpus_per_node
        curve = (self.core_expert_curve if one_core and self.core_expert_curve
                 else tuple((rows, seconds * k) for rows, seconds in self.expert_curve))
        fp32 = (self.core_peak_flops_fp32 if one_core and self.core_peak_flops_fp32
                else self.peak_flops_fp32 / k)
        bandwidth = (self.core_mem_bandwidth if one_core and self.core_mem_bandwidth
                     else self.mem_bandwidth / k)
        return dataclasses.replace(
            self, peak_flops_bf16=self.peak_flops_bf16 / k,
            peak_flops_fp8=self.peak_flops_fp8 / k, peak_flops_fp32=fp32,
            mem_bandwidth=bandwidth, expert_curve=curve)

    def gemm_efficiency(self, rows: float) -> float:
        """Fraction of peak FLOP/s a GEMM with ``rows`` rows (M) reaches."""
        if rows <= 0:
            return self.gemm_plateau_eff
        return self.gemm_plateau_eff * rows / (rows + self.gemm_half_m)

    def peak_flops(self, dtype: str) -> float:
        """Peak dense matmul FLOP/s for weights of ``dtype`` ("fp8", "bf16", "fp32")."""
        if dtype == "fp8":
            return self.peak_flops_fp8 or self.peak_flops_bf16
        if dtype == "fp32":
            return self.peak_flops_fp32 or self.peak_flops_bf16 / 2
        return self.peak_flops_bf16

    def to_json_dict(self) -> dict:
        return dataclasses.asdict(self)


_HOPPER_LINKS = dict(
    nvlink_bandwidth=450 * GB, nvlink_latency_s=NVLINK_LATENCY_S,
    internode_bandwidth=50 * GB, internode_latency_s=IB_LATENCY_S, gpus_per_node=8,
)

H100 = HardwareProfile(
    name="h100", peak_flops_bf16=989 * TB, peak_flops_fp8=1979 * TB,
    mem_bandwidth=3.35 * TB, memory_bytes=80 * GB, **_HOPPER_LINKS,
    a2a_in_pipeline_factor=A2A_IN_PIPELINE_FACTOR,
    source="NVIDIA H100 SXM5 datasheet; DeepGEMM/FlashMLA/DeepEP READMEs (H800) for efficiencies",
)
H200 = dataclasses.replace(
    H100, name="h200", mem_bandwidth=4.8 * TB, memory_bytes=141 * GB,
    source="NVIDIA H200 SXM datasheet; DeepGEMM/FlashMLA/DeepEP READMEs (H800) for efficiencies",
)
# DeepEP's own test machine: H100 compute and HBM, NVLink cut to 400 GB/s bidirectional, of
# which DeepEP quotes ~160 GB/s as the per-direction maximum it can use.
H800 = dataclasses.replace(
    H100, name="h800", nvlink_bandwidth=160 * GB,
    source="H800 SXM5: H100 compute/HBM; NVLink ~160 GB/s and CX7 ~50 GB/s as DeepEP README",
)
B200 = HardwareProfile(
    name="b200", peak_flops_bf16=2250 * TB, peak_flops_fp8=4500 * TB,
    mem_bandwidth=8.0 * TB, memory_bytes=180 * GB,
    nvlink_bandwidth=900 * GB, nvlink_latency_s=NVLINK_LATENCY_S,
    internode_bandwidth=50 * GB, internode_latency_s=IB_LATENCY_S, gpus_per_node=8,
    num_sms=B200_SMS, a2a_nvlink_eff=DEEPEP_NVLINK_EFF_SM100,
    a2a_in_pipeline_factor=A2A_IN_PIPELINE_FACTOR,
    source="NVIDIA DGX B200 datasheet (per GPU = system / 8); DeepEP V2 README (SM100 NVLink)",
)

CPU_PROFILE_PATH = os.path.join(os.path.dirname(__file__), "profiles", "cpu.json")

GPU_PROFILES: Mapping[str, HardwareProfile] = MappingProxyType(
    {"h100": H100, "h200": H200, "h800": H800, "b200": B200}
)


def profile_from_json(data: Mapping) -> HardwareProfile:
    """A profile from its JSON dict (unknown keys ignored, so older files stay loadable)."""
    names = {f.name for f in dataclasses.fields(HardwareProfile)}
    return HardwareProfile(**{k: v for k, v in data.items() if k in names})


def load_profile(name_or_path: str) -> HardwareProfile:
    """A profile by name ("h100", "h200", "h800", "b200", "cpu") or from a JSON file."""
    key = name_or_path.lower()
    if key in GPU_PROFILES:
        return GPU_PROFILES[key]
    path = CPU_PROFILE_PATH if key == "cpu" else name_or_path
    if not os.path.isfile(path):
        known = ", ".join([*GPU_PROFILES, "cpu"])
        raise ValueError(f"unknown hardware profile {name_or_path!r} (known: {known}, or a "
                         "JSON file)")
    with open(path, encoding="utf-8") as f:
        return profile_from_json(json.load(f))


class _Profiles(Mapping):
    """``PROFILES[name]``: the GPU profiles, and "cpu" read from its JSON when asked."""

    def __getitem__(self, key: str) -> HardwareProfile:
        if key == "cpu":
            return load_profile("cpu")
        return GPU_PROFILES[key]

    def __iter__(self):
        return iter([*GPU_PROFILES, "cpu"])

    def __len__(self) -> int:
        return len(GPU_PROFILES) + 1


PROFILES: Mapping[str, HardwareProfile] = _Profiles()
