"""What a simulation measured, from its ``SimResult``: a JSON-able summary (``to_json``), a
plain-text table (``format_table``) and PNG plots over time (``write_plots``).

Definitions (virtual time, finished requests only, as ``widellm bench`` counts them):

- duration: from the first arrival to the last finish;
- throughput per GPU: tokens / duration / GPUs of the whole deployment (prefill and decode
  pools together), output tokens alone and prompt + output tokens; per decode GPU: output
  tokens / duration / GPUs of the pool that produces them (the decode pool of a disaggregated
  deployment, every GPU of a colocated one: vLLM's "decode TPGS");
- median window: the median over the time series' windows of output tokens/s per GPU (and per
  decode GPU), a steady-state reading that ramp-up and drain, a minority of windows in a long
  run, do not move;
- TTFT = first token - arrival; E2E = finish - arrival; ITL = (finish - first token) /
  (output tokens - 1) per request with at least two output tokens (the simulator keeps no
  per-token times, so this is each request's mean gap, vLLM's TPOT);
- percentiles are numpy's linear interpolation (vLLM bench's), in milliseconds;
- balancedness: each step's mean / max routed expert tokens over ranks; mean and min over a
  pool's steps;
- step breakdown: for each rank, the mean seconds per step of each phase of its cost
  breakdown (and of the step's total), then the max and mean of that over the ranks.

Over time, the run is cut into ``NUM_WINDOWS`` equal windows and each output batch's tokens
count in the window in which they reached the frontend.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import numpy as np

from widellm.sim.types import RequestRecord, SimResult, StepRecord

MS_PER_S = 1000.0
PERCENTILES = {"median": 50, "p90": 90, "p99": 99}
# Windows the run is cut into for the values over time (JSON and plots).
NUM_WINDOWS = 50
TOTAL_PHASE = "total"
PLOT_DPI = 100
PLOT_SIZE_IN = (8.0, 4.5)
PLOT_FILES = {"throughput": "throughput.png", "latency": "latency.png",
              "balancedness": "balancedness.png"}


def latency_stats(seconds: list[float] | np.ndarray) -> dict[str, float | None]:
    """mean / median / p90 / p99 of ``seconds``, in milliseconds (None when empty)."""
    values = np.asarray(seconds, dtype=np.float64) * MS_PER_S
    if values.size == 0:
        return {"mean": None, **{name: None for name in PERCENTILES}}
    stats = {"mean": float(values.mean())}
    stats.update({name: float(np.percentile(values, q)) for name, q in PERCENTILES.items()})
    return stats


def _finished(result: SimResult) -> list[RequestRecord]:
    return [r for r in result.requests if r.finish_s is not None]


def _span(result: SimResult) -> tuple[float, float]:
    """(first arrival, last finish); (0, 0) when nothing finished."""
    done = _finished(result)
    if not done:
        return 0.0, 0.0
    return min(r.arrival_s for r in result.requests), max(r.finish_s for r in done)


def _latencies(done: list[RequestRecord]) -> dict[str, list[float]]:
    ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    e2e = [r.finish_s - r.arrival_s for r in done]
    itl = [(r.finish_s - r.first_token_s) / (r.num_output_tokens - 1) for r in done
           if r.first_token_s is not None and r.num_output_tokens > 1]
    return {"ttft": ttft, "itl": itl, "e2e": e2e}


def _steps_by_pool(steps: list[StepRecord]) -> dict[str, list[StepRecord]]:
    pools: dict[str, list[StepRecord]] = defaultdict(list)
    for step in steps:
        pools[step.pool].append(step)
    return dict(pools)


def _balancedness(steps: list[StepRecord]) -> dict[str, float | int | None]:
    values = np.array([s.balancedness for s in steps], dtype=np.float64)
    values = values[np.isfinite(values)]  # a step with no routed token has no balancedness
    if values.size == 0:
        return {"mean": None, "min": None, "num_steps": 0}
    return {"mean": float(values.mean()), "min": float(values.min()),
            "num_steps": int(values.size)}


def _breakdown(steps: list[StepRecord]) -> dict[str, Any]:
    """Per-phase mean seconds per step of each rank, and their max / mean over ranks."""
    num_ranks = max(len(s.costs) for s in steps)
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0] * num_ranks)
    for step in steps:
        for rank, cost in enumerate(step.costs):
            sums[TOTAL_PHASE][rank] += cost.total_s
            for phase, seconds in cost.breakdown.items():
                sums[phase][rank] += seconds
    phases = {}
    for phase in sorted(sums, key=lambda p: (p == TOTAL_PHASE, p)):  # total last
        per_rank = np.array(sums[phase]) / len(steps)
        phases[phase] = {"rank_max": float(per_rank.max()), "rank_mean": float(per_rank.mean()),
                         "per_rank": per_rank.tolist()}
    return {
        "num_steps": len(steps),
        "mean_step_s": float(np.mean([s.duration_s for s in steps])),
        "dbo_fraction": float(np.mean([s.split for s in steps])),
        "phases": phases,
    }


def _cumulative_output_tokens(events: list[tuple[float, int]], times: np.ndarray) -> np.ndarray:
    """Output tokens that had reached the frontend by each of ``times`` (``events``: the
    run's (time, tokens) output batches, in time order)."""
    if not events:
        return np.zeros(len(times))
    at = np.array([t for t, _ in events])
    total = np.cumsum([n for _, n in events], dtype=np.float64)
    idx = np.searchsorted(at, times, side="right")
    return np.where(idx > 0, total[np.maximum(idx - 1, 0)], 0.0)


def timeseries(result: SimResult, num_windows: int = NUM_WINDOWS) -> dict[str, Any]:
    """Window edges (seconds from the first arrival) and per window: output tokens/s per GPU
    (every token that reached the frontend in the window, finished request or not), and each
    pool's mean and min step balancedness (None: no step started in it)."""
    start, end = _span(result)
    done = _finished(result)
    if not done or end <= start:
        return {"window_s": 0.0, "edges_s": [], "output_throughput_per_gpu": [],
                "balancedness": {}}
    edges = np.linspace(start, end, num_windows + 1)
    produced = _cumulative_output_tokens(result.output_events, edges)
    width = (end - start) / num_windows
    throughput = np.diff(produced) / width / max(result.num_gpus, 1)
    balance = {}
    for pool, steps in _steps_by_pool(result.steps).items():
        starts = np.array([s.start_s for s in steps])
        values = np.array([s.balancedness for s in steps], dtype=np.float64)
        which = np.clip(np.searchsorted(edges, starts, side="right") - 1, 0, num_windows - 1)
        means, mins = [], []
        for w in range(num_windows):
            inside = values[(which == w) & np.isfinite(values)]
            means.append(float(inside.mean()) if inside.size else None)
            mins.append(float(inside.min()) if inside.size else None)
        balance[pool] = {"mean": means, "min": mins}
    return {"window_s": width, "edges_s": (edges - start).tolist(),
            "output_throughput_per_gpu": throughput.tolist(), "balancedness": balance}


def decode_gpus(result: SimResult) -> int:
    """GPUs of the pool whose steps produce the output tokens: the decode pool of a
    disaggregated deployment, else the whole deployment."""
    decode = result.config.get("decode")
    return int(decode["num_ranks"]) if isinstance(decode, dict) else max(result.num_gpus, 1)


def to_json(result: SimResult, num_windows: int = NUM_WINDOWS) -> dict[str, Any]:
    """The run's summary as plain JSON types."""
    done = _finished(result)
    start, end = _span(result)
    duration = end - start
    output_tokens = sum(r.num_output_tokens for r in done)
    prompt_tokens = sum(r.num_prompt_tokens for r in done)
    gpus = max(result.num_gpus, 1)
    n_decode = decode_gpus(result)
    rate = (lambda amount: amount / duration) if duration > 0 else (lambda amount: 0.0)
    series = timeseries(result, num_windows)
    windows = series["output_throughput_per_gpu"]
    median_window = float(np.median(windows)) if windows else 0.0
    return {
        "num_requests": len(result.requests),
        "num_finished": len(done),
        "num_gpus": result.num_gpus,
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(output_tokens),
        "total_throughput": rate(output_tokens + prompt_tokens),
        "output_throughput_per_gpu": rate(output_tokens) / gpus,
        "total_throughput_per_gpu": rate(output_tokens + prompt_tokens) / gpus,
        "decode_gpus": n_decode,
        "output_throughput_per_decode_gpu": rate(output_tokens) / n_decode,
        "median_window_output_throughput_per_gpu": median_window,
        "median_window_output_throughput_per_decode_gpu": median_window * gpus / n_decode,
        **{f"{name}_ms": latency_stats(values) for name, values in _latencies(done).items()},
        "balancedness": {pool: _balancedness(steps)
                         for pool, steps in _steps_by_pool(result.steps).items()},
        "step_breakdown": {pool: _breakdown(steps)
                           for pool, steps in _steps_by_pool(result.steps).items()},
        "timeseries": series,
        "num_steps": len(result.steps),
        "sim_wall_s": result.sim_wall_s,
        "config": result.config,
    }


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(summary: dict[str, Any]) -> str:
    """``to_json``'s summary as a plain-text table."""
    s = summary
    lines = [
        f"requests      {s['num_finished']} / {s['num_requests']} finished on {s['num_gpus']} "
        f"GPUs in {s['duration_s']:.3f} s (virtual; {s['num_steps']} steps, simulated in "
        f"{s['sim_wall_s']:.1f} s)",
        f"tokens        {s['prompt_tokens']} prompt + {s['output_tokens']} output",
        f"throughput    {s['output_throughput_per_gpu']:.1f} output tok/s/GPU, "
        f"{s['total_throughput_per_gpu']:.1f} total tok/s/GPU, "
        f"{s['request_throughput']:.2f} req/s",
        f"steady        {s['median_window_output_throughput_per_gpu']:.1f} output tok/s/GPU in "
        f"the median window; per decode GPU ({s['decode_gpus']}): "
        f"{s['output_throughput_per_decode_gpu']:.1f} over the run, "
        f"{s['median_window_output_throughput_per_decode_gpu']:.1f} in the median window",
        "",
        f"{'latency (ms)':<14}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}",
    ]
    for name in ("ttft", "itl", "e2e"):
        st = s[f"{name}_ms"]
        lines.append(f"{name.upper():<14}" + "".join(
            f"{_num(st[key]):>10}" for key in ("mean", "median", "p90", "p99")))
    lines += ["", f"{'balancedness':<14}{'mean':>10}{'min':>10}{'steps':>10}"]
    for pool, b in s["balancedness"].items():
        lines.append(f"{pool:<14}{_num(b['mean'], 3):>10}{_num(b['min'], 3):>10}"
                     f"{b['num_steps']:>10}")
    for pool, b in s["step_breakdown"].items():
        lines += ["", f"step time, {pool} pool: {b['num_steps']} steps, mean "
                      f"{b['mean_step_s'] * MS_PER_S:.3f} ms, DBO in "
                      f"{b['dbo_fraction'] * 100:.0f}% of steps",
                  f"{'phase (ms/step)':<18}{'rank max':>12}{'rank mean':>12}"]
        for phase, p in b["phases"].items():
            lines.append(f"{phase:<18}{p['rank_max'] * MS_PER_S:>12.3f}"
                         f"{p['rank_mean'] * MS_PER_S:>12.3f}")
    return "\n".join(lines)


def _figure():
    # The object API, not pyplot: no global backend or figure registry is touched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=PLOT_SIZE_IN, dpi=PLOT_DPI)
    FigureCanvasAgg(fig)
    return fig


def write_plots(result: SimResult, plot_dir: str,
                num_windows: int = NUM_WINDOWS) -> list[str]:
    """PNG files of throughput, latency and balancedness over time in ``plot_dir``; returns
    their paths."""
    os.makedirs(plot_dir, exist_ok=True)
    series = timeseries(result, num_windows)
    start, _ = _span(result)
    centers = np.asarray(series["edges_s"][:-1]) + series["window_s"] / 2
    paths = []

    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(centers, series["output_throughput_per_gpu"], marker=".")
    ax.set(xlabel="time (s)", ylabel="output tok/s per GPU", title="Throughput over time")
    paths.append(_save(fig, plot_dir, "throughput"))

    fig = _figure()
    ax = fig.add_subplot()
    done = _finished(result)
    finish = [r.finish_s - start for r in done]
    ax.scatter(finish, [(r.finish_s - r.arrival_s) * MS_PER_S for r in done], s=4, label="E2E")
    with_first = [r for r in done if r.first_token_s is not None]
    ax.scatter([r.finish_s - start for r in with_first],
               [(r.first_token_s - r.arrival_s) * MS_PER_S for r in with_first], s=4,
               label="TTFT")
    ax.set(xlabel="finish time (s)", ylabel="latency (ms)", title="Latency by finish time")
    ax.legend()
    paths.append(_save(fig, plot_dir, "latency"))

    fig = _figure()
    ax = fig.add_subplot()
    for pool, values in series["balancedness"].items():
        mean = [np.nan if v is None else v for v in values["mean"]]
        low = [np.nan if v is None else v for v in values["min"]]
        ax.plot(centers, mean, marker=".", label=f"{pool} mean")
        ax.plot(centers, low, linestyle="--", label=f"{pool} min")
    ax.set(xlabel="time (s)", ylabel="balancedness (mean / max)", ylim=(0, 1.05),
           title="Expert load balancedness over time")
    if series["balancedness"]:
        ax.legend()
    paths.append(_save(fig, plot_dir, "balancedness"))
    return paths


def _save(fig, plot_dir: str, name: str) -> str:
    path = os.path.join(plot_dir, PLOT_FILES[name])
    fig.tight_layout()
    fig.savefig(path)
    return path
