"""Time widellm's own CPU kernels for the "cpu" profile: the linear layer (with the method the
loader would give it) and the routed-expert kernel (``experts_forward``).

The linear is timed at two row counts over the same weights, and the two timings are solved for
``time = weight bytes / bandwidth + FLOPs / rate``: on this CPU the small-row call is bound by
the weight read and the large-row call by compute, and the two parts add (the kernel does not
overlap them much), so the cost model prices GEMMs as that sum (``roofline_overlap`` 0). The
expert kernel changes its layout with the rows per expert (a Python loop of small matmuls, or
one padded batched matmul), so no single roofline fits it: it is timed over a curve of mean
rows per expert, which the cost model interpolates.

The weights are larger than a last-level cache (64 MiB for the linear, 288 MiB for the
experts) and fp32, the dtype CPU runs use. The expert shape is deepseek-v3-small's MoE
(64 experts, hidden 1024, intermediate 384), rows routed uniformly at random.
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

LINEAR_FEATURES = 4096
LINEAR_ROWS = (16, 1024)
EXPERT_SHAPE = (64, 1024, 384)  # experts, hidden, intermediate
# Mean rows per expert of the measured curve: from a decode step of a few sequences to a prefill
# chunk. The engine's kernel changes layout with it (``experts_forward``), so its cost is not
# one roofline; the cost model interpolates this curve instead.
EXPERT_CURVE_ROWS_PER_EXPERT = (0.25, 0.75, 1.5, 3.0, 6.0, 16.0, 64.0, 192.0)
DTYPE = torch.float32


@dataclass(frozen=True, slots=True)
class KernelFit:
    """``time = bytes / bandwidth + flops / flops_rate`` for one kernel."""

    bandwidth: float  # bytes/s of the weight read
    flops_rate: float  # FLOP/s


def fit_two_points(weight_bytes: float, flops: tuple[float, float],
                   seconds: tuple[float, float]) -> KernelFit:
    """Solve the two timings (small rows first) for the bandwidth and FLOP rate.

    Example: 100 bytes of weights; 10 FLOPs in 2 s, 110 FLOPs in 3 s -> 1 s per 100 FLOPs
    (rate 100), so the small call's read took 2 - 0.1 = 1.9 s (bandwidth 100 / 1.9).
    """
    (f_small, f_large), (t_small, t_large) = flops, seconds
    rate = (f_large - f_small) / max(t_large - t_small, 1e-12)
    # A disturbed large-row timing can leave no time for the read; keep it positive.
    read_s = max(t_small - f_small / rate, 0.05 * t_small)
    return KernelFit(bandwidth=weight_bytes / read_s, flops_rate=rate)


def best_time(fn: Callable[[], object], reps: int, min_s: float = 0.0) -> float:
    """Fastest single call of ``fn`` in ``reps * min_s`` seconds of calls (at least ``reps``
    calls): the least disturbed by other load on a shared machine, which only ever adds."""
    fn()
    budget = reps * min_s
    best, calls, start = float("inf"), 0, time.perf_counter()
    while calls < reps or time.perf_counter() - start < budget:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return best


def measure_linear(reps: int) -> KernelFit:
    """The engine's ``Linear`` (oneDNN-packed where the loader would pack it)."""
    from widellm.layers.linear import Linear, pack_linear_weights

    holder = nn.Module()
    holder.proj = Linear(LINEAR_FEATURES, LINEAR_FEATURES, bias=False, dtype=DTYPE)
    pack_linear_weights(holder)
    weight_bytes = LINEAR_FEATURES * LINEAR_FEATURES * DTYPE.itemsize
    flops, seconds = [], []
    with torch.inference_mode():
        for rows in LINEAR_ROWS:
            x = torch.randn(rows, LINEAR_FEATURES, dtype=DTYPE)
            seconds.append(best_time(lambda: holder.proj(x), reps))
            flops.append(2.0 * rows * LINEAR_FEATURES * LINEAR_FEATURES)
    return fit_two_points(weight_bytes, tuple(flops), tuple(seconds))


def _expert_inputs(per_expert: float, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    experts, hidden, inter = EXPERT_SHAPE
    rows = max(1, round(experts * per_expert))
    x = torch.randn(rows, hidden, generator=gen, dtype=DTYPE)
    # Uniformly random experts, as a router spreads tokens: per-expert counts vary, and the
    # kernel pays for that (padding to row buckets), as in the engine.
    return x, torch.randint(0, experts, (rows,), generator=gen)


def _expert_weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    experts, hidden, inter = EXPERT_SHAPE
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, dtype=DTYPE) * 0.02
    w2 = torch.randn(experts, hidden, inter, generator=gen, dtype=DTYPE) * 0.02
    return w13, w2


def measure_expert_curve(reps: int) -> tuple[tuple[float, float], ...]:
    """``((rows per expert, seconds per byte of all the experts' weights), ...)`` of the
    engine's routed-expert kernel over :data:`EXPERT_CURVE_ROWS_PER_EXPERT`."""
    from widellm.layers.moe.experts import experts_forward

    gen = torch.Generator().manual_seed(0)
    w13, w2 = _expert_weights(gen)
    weight_bytes = (w13.numel() + w2.numel()) * DTYPE.itemsize
    curve = []
    with torch.inference_mode():
        for per_expert in EXPERT_CURVE_ROWS_PER_EXPERT:
            x, ids = _expert_inputs(per_expert, gen)
            seconds = best_time(lambda: experts_forward(x, ids, w13, w2), reps)
            curve.append((per_expert, seconds / weight_bytes))
    return tuple(curve)


# The neighbour rank: the same kernel on one thread in a loop, in its own process (ranks are
# processes, so they share cores, caches and memory bandwidth but no GIL).
_NEIGHBOUR = """
import torch
from widellm.sim.profiles.measure_kernels import _expert_inputs, _expert_weights
from widellm.layers.moe.experts import experts_forward
torch.set_num_threads(1)
gen = torch.Generator().manual_seed(1)
w13, w2 = _expert_weights(gen)
x, ids = _expert_inputs(3.0, gen)
print("ready", flush=True)
with torch.inference_mode():
    while True:
        experts_forward(x, ids, w13, w2)
"""
NEIGHBOUR_START_TIMEOUT_S = 120


@contextlib.contextmanager
def busy_neighbour() -> Iterator[None]:
    """Another process running the expert kernel on one thread while the block runs: what a
    rank's kernel meets when the ranks of one machine step together."""
    proc = subprocess.Popen([sys.executable, "-c", _NEIGHBOUR], stdout=subprocess.PIPE,
                            text=True)
    try:
        # Its "ready" line, or nothing within the timeout (a watchdog: readline alone would
        # wait forever on a neighbour stuck before printing).
        ready, _, _ = select.select([proc.stdout], [], [], NEIGHBOUR_START_TIMEOUT_S)
        if not ready or proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the neighbour process did not start ({proc.poll()})")
        yield
    finally:
        proc.kill()
        proc.wait()
