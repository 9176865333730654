"""The simulator against the real engine on this machine: the same offline workload (``bench
throughput``'s: random token-id prompts, greedy, every request ``output_len`` tokens) run by
``LLM`` and by the simulator with a CPU profile measured here, compared on output tok/s and
the mean step time (wall seconds / engine steps).

The profile comes from micro-benchmarks (``profiles/measure_cpu.py``: matmul peak, copy
bandwidth, widellm's linear and expert kernels, gloo all-to-all) plus two numbers taken from
the engine itself: the host time per step and per sequence of a step that no kernel benchmark
sees (Python around every op, sampling, per-request bookkeeping). They are fitted on *probes*
on one rank, ``PROBE_SIZES`` sequences decoding short prompts, as the real mean step time minus
the simulated one: the least-squares line through those residuals (each residual is host time
plus the cost model's own error at that size, which bends where the measured expert curve
does; a line through two sizes extrapolated one size's bump to every batch, docs/BENCHMARKS.md).
The cases compared afterwards (other prompt and output lengths, two expert-parallel ranks) are
not used to fit anything.

Every engine number is the fastest of ``repeats`` runs of the same shape (fresh prompts each
time, probes interleaved), as the profile's micro-benchmarks are the fastest of many calls:
load from elsewhere on a shared machine only ever makes a run slower, and one disturbed probe
would otherwise skew the fitted host time and every prediction made with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import os
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any

from widellm.sim.hardware import HardwareProfile

PROBE_INPUT_LEN = 16
PROBE_OUTPUT_LEN = 32
# Spread up to the batch sizes the calibration's cases decode (16 in the suite, 32 in the
# benchmark), not at them.
PROBE_SIZES = (1, 8, 16, 24)


@dataclass(frozen=True, slots=True)
class CalibrationCase:
    """One workload on one deployment (DP > 1 runs expert-parallel with ``all2all_backend``)."""

    name: str
    data_parallel_size: int
    num_prompts: int
    input_len: int
    output_len: int
    all2all_backend: str = "all2all"


@dataclass(frozen=True, slots=True)
class RunNumbers:
    output_tok_s: float
    mean_step_s: float
    num_steps: int


@dataclass(frozen=True, slots=True)
class CalibrationRow:
    case: CalibrationCase
    real: RunNumbers
    simulated: RunNumbers

    @property
    def throughput_error(self) -> float:
        return self.simulated.output_tok_s / self.real.output_tok_s - 1.0

    @property
    def step_time_error(self) -> float:
        return self.simulated.mean_step_s / self.real.mean_step_s - 1.0


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What both sides are given: the model and the engine's knobs that shape its steps."""

    model: str
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    seed: int = 0


def _engine_steps(llm: Any) -> int:
    engine = llm.llm_engine
    if engine.client is None:
        return engine.engine_core.num_steps
    return max((s.num_steps for s in engine.client.last_stats.values()), default=0)


def timed_generate(llm: Any, num_prompts: int, input_len: int, output_len: int,
                   seed: int) -> RunNumbers:
    """``num_prompts`` random prompts (drawn from ``seed``) run to ``output_len`` tokens by
    ``llm``, greedy: output tok/s, mean step time and the engine steps taken."""
    from widellm import SamplingParams
    from widellm.bench.datasets import random_token_prompts

    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    prompts = random_token_prompts(num_prompts, input_len, vocab, seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    steps_before = _engine_steps(llm)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    steps = _engine_steps(llm) - steps_before
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return RunNumbers(tokens / elapsed, elapsed / max(steps, 1), steps)


def probe_case(seqs: int) -> CalibrationCase:
    """The probe of ``seqs`` sequences decoding short prompts on one rank."""
    return CalibrationCase("probe", 1, seqs, PROBE_INPUT_LEN, PROBE_OUTPUT_LEN)


def _fastest(runs: list[RunNumbers]) -> RunNumbers:
    return min(runs, key=lambda r: r.mean_step_s)


def make_llm(settings: EngineSettings, data_parallel_size: int = 1,
             all2all_backend: str = "all2all") -> Any:
    """The ``LLM`` the calibration times: ``settings``, expert-parallel when DP > 1."""
    from widellm import LLM

    return LLM(settings.model, dtype=settings.dtype, block_size=settings.block_size,
               num_kv_blocks=settings.num_kv_blocks, max_num_seqs=settings.max_num_seqs,
               max_num_batched_tokens=settings.max_num_batched_tokens, seed=settings.seed,
               data_parallel_size=data_parallel_size,
               enable_expert_parallel=data_parallel_size > 1, all2all_backend=all2all_backend)


def run_engine(settings: EngineSettings, case: CalibrationCase,
               probe_sizes: tuple[int, ...] = (), repeats: int = 1
               ) -> tuple[RunNumbers, dict[int, RunNumbers]]:
    """(the case, and a probe of each of ``probe_sizes`` sequences before it, by size) on the
    real engine, each the fastest of ``repeats`` runs."""
    if probe_sizes and max(probe_sizes) > settings.max_num_seqs:
        raise ValueError(f"a probe of {max(probe_sizes)} sequences needs max_num_seqs >= that "
                         f"(got {settings.max_num_seqs}): it would decode in two batches")
    llm = make_llm(settings, case.data_parallel_size, case.all2all_backend)
    # Every run draws its prompts from its own seed: no prefix of an earlier run's prompts may
    # be in the prefix cache (the simulated runs start cold).
    seeds = itertools.count(settings.seed)
    try:
        probe_runs: dict[int, list[RunNumbers]] = {n: [] for n in probe_sizes}
        for _ in range(repeats):  # interleaved: a slow spell hits one run of each, not all
            for n in probe_sizes:
                probe_runs[n].append(timed_generate(llm, n, PROBE_INPUT_LEN, PROBE_OUTPUT_LEN,
                                                    next(seeds)))
        runs = [timed_generate(llm, case.num_prompts, case.input_len, case.output_len,
                               next(seeds)) for _ in range(repeats)]
        return _fastest(runs), {n: _fastest(r) for n, r in probe_runs.items()}
    finally:
        llm.shutdown()


def simulate_case(settings: EngineSettings, profile: HardwareProfile,
                  case: CalibrationCase) -> RunNumbers:
    """The case in the simulator on ``profile`` (no CUDA graphs: the CPU engine runs eager)."""
    from widellm.sim import cli
    from widellm.sim.cluster import default_cost_model_factory, simulate
    from widellm.sim.report import to_json
    from widellm.sim.workload import generate_requests

    parser = argparse.ArgumentParser()
    cli.add_cli_args(parser)
    weight_dtype = {"float32": "fp32", "bfloat16": "bf16"}[settings.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "profile.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(profile.to_json_dict(), f)
        args = parser.parse_args([
            "--model", settings.model, "--hardware", path, "--enforce-eager",
            "--num-ranks", str(case.data_parallel_size),
            "--all2all-backend", case.all2all_backend,
            "--weight-dtype", weight_dtype, "--block-size", str(settings.block_size),
            "--num-kv-blocks", str(settings.num_kv_blocks),
            "--max-num-seqs", str(settings.max_num_seqs),
            "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
            "--num-requests", str(case.num_prompts), "--input-len", str(case.input_len),
            "--output-len", str(case.output_len), "--seed", str(settings.seed),
        ])
        inputs = cli.build_inputs(args)
        requests = generate_requests(inputs.workload, inputs.hf_config.vocab_size)
        summary = to_json(simulate(inputs.config, default_cost_model_factory(inputs.config),
                                   requests, inputs.routing))
    steps = summary["num_steps"]
    return RunNumbers(summary["output_throughput"], summary["duration_s"] / max(steps, 1),
                      steps)


def without_host_time(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` with no host time per step: what the kernels alone would take."""
    return dataclasses.replace(profile, step_overhead_s=0.0, step_overhead_per_seq_s=0.0)


def host_time_line(sizes: list[int], residuals: list[float]) -> tuple[float, float]:
    """(seconds per step, seconds per sequence): the least-squares line through the
    ``residuals`` (real minus bare simulated mean step, seconds) at ``sizes`` (sequences per
    step), neither part below zero (then the best line with that part at zero).

    >>> host_time_line([1, 8, 16, 24], [0.021, 0.042, 0.049, 0.062])  # doctest: +ELLIPSIS
    (0.0229..., 0.00167...)
    >>> host_time_line([1, 8], [0.030, 0.020])  # falls with the batch: all per step
    (0.025, 0.0)
    """
    if len(set(sizes)) < 2:
        raise ValueError(f"a line needs probes of two sizes or more, got {sizes}")
    per_seq, per_step = statistics.linear_regression(sizes, residuals)
    if per_seq < 0:
        return max(0.0, statistics.fmean(residuals)), 0.0
    if per_step < 0:
        per_seq = statistics.linear_regression(sizes, residuals, proportional=True).slope
        return 0.0, max(0.0, per_seq)
    return per_step, per_seq


def fit_host_overhead(settings: EngineSettings, profile: HardwareProfile,
                      probes: dict[int, RunNumbers]) -> HardwareProfile:
    """``profile`` with ``step_overhead_s`` and ``step_overhead_per_seq_s`` set to the line
    (``host_time_line``) through the probes' residuals: each probe's real mean step minus the
    simulated one without host time. ``probes``: the real runs by sequences per step."""
    bare = without_host_time(profile)
    sizes = sorted(probes)
    residuals = [probes[n].mean_step_s - simulate_case(settings, bare, probe_case(n)).mean_step_s
                 for n in sizes]
    per_step, per_seq = host_time_line(sizes, residuals)
    source = (f"{profile.source}; host time per step fitted on probes of "
              f"{', '.join(map(str, sizes))} sequences of {settings.model} ({settings.dtype}) "
              f"by widellm.sim.calibration")
    return dataclasses.replace(profile, step_overhead_s=per_step,
                               step_overhead_per_seq_s=per_seq, source=source)


@dataclass(frozen=True, slots=True)
class Calibration:
    """A calibration's result: the fitted profile, a row per case, and the probes (real runs,
    by sequences per step) the profile's host time was fitted on."""

    profile: HardwareProfile
    rows: list[CalibrationRow]
    probes: dict[int, RunNumbers]


def simulate_rows(settings: EngineSettings, profile: HardwareProfile,
                  real: dict[str, RunNumbers], cases: list[CalibrationCase]
                  ) -> list[CalibrationRow]:
    """A row per case: its ``real`` run (by case name) against the simulation on ``profile``."""
    return [CalibrationRow(c, real[c.name], simulate_case(settings, profile, c)) for c in cases]


def calibrate(settings: EngineSettings, profile: HardwareProfile, cases: list[CalibrationCase],
              repeats: int = 2, probe_sizes: tuple[int, ...] = PROBE_SIZES) -> Calibration:
    """Run every case on the engine (the probes with the first DP1 case), each the fastest
    of ``repeats`` runs, fit the host overhead on the probes, then simulate every case."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    real: dict[str, RunNumbers] = {}
    probes: dict[int, RunNumbers] = {}
    for case in cases:
        wanted = probe_sizes if not probes and case.data_parallel_size == 1 else ()
        real[case.name], probed = run_engine(settings, case, wanted, repeats)
        probes = probes or probed
    if not probes:
        raise ValueError("the cases need one on a single rank (DP1) to carry the probes")
    fitted = fit_host_overhead(settings, profile, probes)
    return Calibration(fitted, simulate_rows(settings, fitted, real, cases), probes)


def _calibrate_child(conn: Any, settings: EngineSettings, cases: list[CalibrationCase],
                     quick_profile: bool, repeats: int) -> None:
    from widellm.sim.profiles.measure_cpu import measure_cpu_profile

    try:
        profile = measure_cpu_profile(quick=quick_profile)
        conn.send(("ok", calibrate(settings, profile, cases, repeats)))
    except BaseException:  # the parent raises it with the child's traceback
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def calibrate_in_fresh_process(settings: EngineSettings, cases: list[CalibrationCase],
                               quick_profile: bool = True, repeats: int = 2,
                               timeout_s: float = 600.0) -> Calibration:
    """Measure this machine's profile, then ``calibrate``, in a fresh (spawned) process: a
    one-rank engine runs in its caller's process, so a long-lived caller (a test session: its
    heap, threads left by earlier tests) would slow the real side and not the profile's
    kernels; ``bench throughput`` and ``benchmarks/sim_calibration.py`` start fresh too. The
    child is killed if it has not answered within ``timeout_s``."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_calibrate_child,
                       args=(child, settings, cases, quick_profile, repeats))
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"calibration did not finish within {timeout_s:g} s")
        status, value = parent.recv()
    except EOFError:
        raise RuntimeError(f"the calibration process died (exit code {proc.exitcode})") from None
    finally:
        if proc.is_alive():
            proc.join(timeout=5.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent.close()
    if status != "ok":
        raise RuntimeError(f"calibration failed in its process:\n{value}")
    return value
