"""Measure this machine's ``HardwareProfile`` ("cpu"): torch matmul throughput at several row
counts (bf16, fp32), memory-copy bandwidth, the host cost of one small torch op, an
attention-shaped batched matmul, gloo all-to-all latency and bandwidth between two local
processes (idle, and between ranks that compute in between: the lockstep exchange's real
cost), and widellm's own linear and routed-expert kernels (``measure_kernels.py``) on all
threads and on one thread next to a busy neighbour process (the ``core_*`` fields a DP rank
with one core uses). ``quick=True`` takes about 20 s on a 2-core machine.

Every measured number is the fastest of many single calls (other load on the cores only ever
makes a call slower), except the busy all-to-all (a median); run it on an idle machine all the
same. The generic compute figures (matmuls, the small op, attention) are timed on one thread
and scaled by the thread count (see ``_one_thread``); the copy bandwidth and the engine kernels
use every thread. The GEMM curve is stored as ``peak_flops_bf16`` (the peak of the fitted curve)
with ``gemm_half_m`` fitted to the measured rise with M; ``attn_compute_eff`` is the
attention-shaped bmm's throughput over that peak (a torch proxy, not widellm's own MLA kernel).
The host time per engine step is not measured here: ``widellm.sim.calibration`` fits it on
probes of the real engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
from typing import Iterator

import torch

from widellm.sim.hardware import HardwareProfile
from widellm.sim.profiles.measure_kernels import (
    best_time, busy_neighbour, measure_expert_curve, measure_linear,
)

MATMUL_K = MATMUL_N = 1024  # weights of 2 MB in bf16: cache resident, so compute is measured
MATMUL_ROWS = (1, 8, 32, 128, 512, 2048)
COPY_BYTES = 256 * 2**20  # far beyond the last-level cache
SMALL_OP_SHAPE = (64, 1024)
A2A_SMALL_BYTES = 4096
A2A_LARGE_BYTES = 16 * 2**20
HALF_M_CANDIDATES = tuple(float(2**i) for i in range(0, 13))
ATTN_SHAPE = (64, 16, 576, 512, 256)  # sequences, heads, score dim, value dim, context


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Compute is timed on one thread and scaled by the thread count: on a shared machine
    every multi-threaded call waits at OpenMP's barrier for a thread the scheduler parked
    (milliseconds), which would swamp small calls; one thread per core scales linearly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _matmul_flops(rows: int, dtype: torch.dtype, reps: int, min_s: float) -> float:
    x = torch.randn(rows, MATMUL_K).to(dtype)
    w = torch.randn(MATMUL_N, MATMUL_K).to(dtype)
    seconds = best_time(lambda: torch.nn.functional.linear(x, w), reps, min_s)
    return 2.0 * rows * MATMUL_K * MATMUL_N / seconds


def _fit_half_m(curve: dict[int, float]) -> tuple[float, float]:
    """(peak, half_m) of ``flops(M) = peak * M / (M + half_m)`` closest to the measured curve:
    for each candidate half point the peak is the median implied by the points, and the error
    the sum of squared log ratios (robust to one disturbed point)."""
    best = (max(curve.values()), 1.0, float("inf"))
    for h in HALF_M_CANDIDATES:
        implied = sorted(f * (m + h) / m for m, f in curve.items())
        peak = implied[len(implied) // 2]
        err = sum(math.log(peak * m / (m + h) / f) ** 2 for m, f in curve.items())
        if err < best[2]:
            best = (peak, h, err)
    return best[0], best[1]


def _copy_bandwidth(reps: int, min_s: float) -> float:
    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = best_time(lambda: dst.copy_(src), reps, min_s)
    return 2.0 * COPY_BYTES / seconds  # read + write


def _small_op_seconds(reps: int, min_s: float) -> float:
    a = torch.randn(*SMALL_OP_SHAPE).to(torch.bfloat16)
    b = torch.randn(*SMALL_OP_SHAPE).to(torch.bfloat16)
    return best_time(lambda: a + b, reps, min_s)


def _attention_flops(reps: int, min_s: float) -> float:
    seqs, heads, d_qk, d_v, ctx = ATTN_SHAPE
    q = torch.randn(seqs, heads, d_qk).to(torch.bfloat16)
    k = torch.randn(seqs, ctx, d_qk).to(torch.bfloat16)
    v = torch.randn(seqs, ctx, d_v).to(torch.bfloat16)

    def attend() -> torch.Tensor:
        p = torch.softmax(torch.bmm(q, k.transpose(1, 2)).float(), dim=-1).to(torch.bfloat16)
        return torch.bmm(p, v)

    seconds = best_time(attend, reps, min_s)
    return 2.0 * seqs * heads * ctx * (d_qk + d_v) / seconds


# The all-to-all worker runs as ``python -c`` with only torch imported: spawning it through
# multiprocessing would import the whole widellm package in each child (seconds each).
_A2A_WORKER = """
import sys, time, torch, torch.distributed as dist
rank, store, reps, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
results = []
for num_bytes in (int(sys.argv[5]), int(sys.argv[6])):
    send = torch.ones(2 * num_bytes // 4, dtype=torch.float32)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_to_all_single(recv, send)
        best = min(best, time.perf_counter() - start)
    results.append(best)
# Between busy ranks: each computes a few ms on its one core, then they exchange; the median
# exchange (not the best) includes waking the peer and the skew of two busy processes, as a
# rank's all-to-all meets them in the engine's lockstep.
w, x = torch.randn(2048, 2048), torch.randn(64, 2048)
send = torch.ones(2 * int(sys.argv[5]) // 4, dtype=torch.float32)
recv = torch.empty_like(send)
times = []
for _ in range(4 * reps):
    for _ in range(4):
        torch.mm(x, w.t())
    start = time.perf_counter()
    dist.all_to_all_single(recv, send)
    times.append(time.perf_counter() - start)
results.append(sorted(times)[len(times) // 2])
if rank == 0:
    with open(out, "w") as f:
        f.write(" ".join(repr(r) for r in results))
dist.destroy_process_group()
"""
A2A_TIMEOUT_S = 120


def _gloo_all_to_all(reps: int) -> tuple[float, float, float]:
    """(latency s, bandwidth B/s per direction, latency between busy ranks s) of a 2-process
    gloo all-to-all on this host: latency from a 4 KB exchange, bandwidth from the extra time
    of a 16 MB one, the busy latency from 4 KB exchanges between bursts of compute."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out")
        procs = [subprocess.Popen([sys.executable, "-c", _A2A_WORKER, str(rank), store,
                                   str(reps), out, str(A2A_SMALL_BYTES), str(A2A_LARGE_BYTES)])
                 for rank in range(2)]
        try:
            for proc in procs:
                if proc.wait(timeout=A2A_TIMEOUT_S) != 0:
                    raise RuntimeError(f"gloo all-to-all worker failed ({proc.returncode})")
        finally:  # a failed or hung worker leaves its peer waiting in the collective
            for proc in procs:
                proc.kill()
                proc.wait()
        with open(out, encoding="utf-8") as f:
            small, large, busy = (float(x) for x in f.read().split())
    bandwidth = (A2A_LARGE_BYTES - A2A_SMALL_BYTES) / max(large - small, 1e-9)
    return small, bandwidth, busy


def _engine_kernel_fields(peak_fp32: float, bandwidth: float, reps: int) -> dict:
    """Fields from timings of widellm's own linear and expert kernels (``measure_kernels``),
    on all threads and on one thread next to a busy neighbour (the ``core_*`` fields). A
    read-only weight stream can beat the copy bandwidth, and the packed linear the plain
    matmul's peak, so those two are raised to what the linear reached; the core figures are
    stored so that the same GEMM efficiencies apply to them."""
    linear = measure_linear(reps)
    with _one_thread(), busy_neighbour():
        core_linear = measure_linear(reps)
        core_curve = measure_expert_curve(reps)
    peak_fp32 = max(peak_fp32, linear.flops_rate)
    bandwidth = max(bandwidth, linear.bandwidth)
    compute_eff, mem_eff = linear.flops_rate / peak_fp32, linear.bandwidth / bandwidth
    return dict(
        peak_flops_fp32=peak_fp32, mem_bandwidth=bandwidth,
        gemm_plateau_eff=compute_eff, gemm_mem_eff=mem_eff,
        expert_curve=measure_expert_curve(reps), roofline_overlap=0.0,
        core_peak_flops_fp32=core_linear.flops_rate / compute_eff,
        core_mem_bandwidth=core_linear.bandwidth / mem_eff, core_expert_curve=core_curve,
    )


def measure_cpu_profile(quick: bool = True, with_all_to_all: bool = True,
                        with_engine_kernels: bool = True) -> HardwareProfile:
    """This machine's profile (see the module docstring); ``quick`` shortens every timing."""
    reps, min_s = (3, 0.05) if quick else (7, 0.2)
    load_at_start = os.getloadavg()[0]
    threads = torch.get_num_threads()
    with _one_thread():
        curve = {m: threads * _matmul_flops(m, torch.bfloat16, reps, min_s)
                 for m in MATMUL_ROWS}
        peak_fp32 = threads * _matmul_flops(MATMUL_ROWS[-1], torch.float32, reps, min_s)
        op_s = _small_op_seconds(reps, min_s)
        attn_flops = threads * _attention_flops(reps, min_s)
    peak_bf16, half_m = _fit_half_m(curve)
    bandwidth = _copy_bandwidth(reps, min_s)
    attn_eff = min(1.0, attn_flops / peak_bf16)
    a2a_latency, a2a_bw, a2a_busy = _gloo_all_to_all(10 if quick else 30) if with_all_to_all \
        else (50e-6, bandwidth / 2, 50e-6)
    kernels = dict(peak_flops_fp32=peak_fp32, mem_bandwidth=bandwidth, gemm_plateau_eff=1.0,
                   gemm_mem_eff=1.0)
    if with_engine_kernels:
        kernels = _engine_kernel_fields(peak_fp32, bandwidth, reps + 2)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (f"measured by widellm.sim.profiles.measure_cpu on {socket.gethostname()} "
              f"({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads) at {stamp}, "
              f"1-min load average {load_at_start:.1f} at the start; "
              f"bf16 matmul GFLOP/s by rows: "
              + ", ".join(f"{m}:{f / 1e9:.0f}" for m, f in curve.items()))
    return HardwareProfile(
        name="cpu", peak_flops_bf16=peak_bf16, peak_flops_fp8=0.0, memory_bytes=float(memory),
        nvlink_bandwidth=a2a_bw, nvlink_latency_s=a2a_latency,
        internode_bandwidth=a2a_bw, internode_latency_s=a2a_latency,
        gpus_per_node=os.cpu_count() or 1, num_sms=0,
        gemm_half_m=half_m, attn_compute_eff=attn_eff, attn_mem_eff=1.0,
        a2a_nvlink_eff=1.0, a2a_rdma_eff=1.0,
        a2a_dispatch_latency_s=a2a_busy, a2a_combine_latency_s=a2a_busy,
        comm_sms_normal=0, dispatch_fp8=False, launch_eager_s=op_s, launch_graph_s=op_s,
        async_launch=False, ranks_share_host=True, fixed_a2a_full_buffer=True,
        source=source, **kernels,
    )


def profile_json(profile: HardwareProfile) -> dict:
    return dataclasses.asdict(profile)
