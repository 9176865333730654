"""How fast the cluster simulator runs (issue 26's goal: 144 ranks x 256 sequences x 2,000
output tokens in under 10 minutes).

DeepSeek-V3's shape (transformers' ``DeepseekV3Config`` defaults: 61 layers, 256 experts,
top-8) on a colocated pool, closed loop with ``--seqs`` requests in flight per rank, every
request ``--prompt-len`` tokens in and ``--output-len`` out. Prints the simulator's wall time
and where it went (``--profile``: cProfile's top functions).

    .venv/bin/python benchmarks/sim_speed.py --ranks 144 --seqs 256 --output-len 2000
    .venv/bin/python benchmarks/sim_speed.py --ranks 16 --seqs 64 --output-len 200 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from widellm.config import EPLBConfig
from widellm.sim.cluster import default_cost_model_factory, simulate
from widellm.sim.config import PoolConfig, SimulationConfig
from widellm.sim.types import RankStepCost

PROFILE_LINES = 30
# Fallback cost when the hardware cost model cannot be built: seconds per row, per step.
FALLBACK_PER_ROW_S = 2e-5
FALLBACK_FIXED_S = 0.02


@dataclass
class _Request:
    request_id: str
    arrival_s: float | None
    prompt_token_ids: list[int]
    max_tokens: int


class _LinearCost:
    def step(self, loads, split):
        t = FALLBACK_FIXED_S + FALLBACK_PER_ROW_S * max(ld.num_tokens for ld in loads)
        return [RankStepCost(t) for _ in loads]


def _model_dir(root: str) -> str:
    import transformers

    transformers.DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"]).save_pretrained(root)
    return root


def _routing(hf_config):
    from widellm.sim.routing import ExpertRouting

    return ExpertRouting.uniform(hf_config.n_routed_experts, hf_config.num_experts_per_tok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=144)
    ap.add_argument("--seqs", type=int, default=256, help="requests in flight per rank")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=2000)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--redundant", type=int, default=32, help="EPLB redundant expert slots")
    ap.add_argument("--fake-cost", action="store_true", help="a linear cost, not the profile's")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        import transformers

        model = _model_dir(tmp)
        hf_config = transformers.AutoConfig.from_pretrained(model)
        config = SimulationConfig(
            model=model, hardware=args.hardware, max_model_len=args.prompt_len + args.output_len,
            colocated=PoolConfig(
                num_ranks=args.ranks, max_num_seqs=args.seqs,
                dbo="auto" if args.ranks > 1 else "off",
                # DeepSeek's deployment: 32 redundant slots (288 = 2 per rank at EP144).
                eplb=EPLBConfig(enable_eplb=args.ranks > 1,
                                num_redundant_experts=args.redundant if args.ranks > 1 else 0)))
        factory = (default_cost_model_factory(config) if not args.fake_cost
                   else (lambda hf, shape: _LinearCost()))
        rng = np.random.default_rng(0)
        vocab = hf_config.vocab_size
        workload = [_Request(f"r{i}", None, rng.integers(0, vocab, args.prompt_len).tolist(),
                             args.output_len) for i in range(args.ranks * args.seqs)]
        profiler = cProfile.Profile() if args.profile else None
        start, cpu_start = time.perf_counter(), time.process_time()
        if profiler:
            profiler.enable()
        result = simulate(config, factory, workload, _routing(hf_config),
                          concurrency_per_rank=args.seqs)
        if profiler:
            profiler.disable()
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu_start  # the machine may be shared: CPU time too
    done = sum(r.finish_s is not None for r in result.requests)
    steps = len(result.steps)
    print(f"{args.ranks} ranks x {args.seqs} seqs x {args.output_len} tokens: {steps} steps, "
          f"{done}/{len(result.requests)} requests finished, virtual "
          f"{result.steps[-1].start_s + result.steps[-1].duration_s:.1f} s, wall {wall:.1f} s "
          f"(CPU {cpu:.1f} s) "
          f"({wall / max(steps, 1) * 1e3:.1f} ms/step, "
          f"{wall / max(steps * args.ranks, 1) * 1e6:.0f} us/rank-step), pid {os.getpid()}")
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(PROFILE_LINES)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(PROFILE_LINES)


if __name__ == "__main__":
    main()
