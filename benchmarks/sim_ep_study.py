"""Issue 26's study: DeepSeek-V3 decode on H200, output tok/s per GPU against the expert-parallel
size (8 to 144), with and without EPLB and DBO, and the share of the step the all-to-all takes.

    .venv/bin/python benchmarks/sim_ep_study.py [--zipf 0.5] [--layers 8]

The setup is vLLM's wide-EP decode (the simulator's first reproduction): 256 sequences per
rank, mean context 3,000, FP8 weights, the fixed-capacity (low-latency) all-to-all, CUDA graphs,
8 GPUs per node. The cost model is the simulator's (``widellm/sim/cost_model.py``: datasheet and
published-kernel constants, one all-to-all factor fitted to DeepSeek's profile; 1.04x SGLang's
decode and 1.44x vLLM's, see docs/BENCHMARKS.md).

Expert load: no public per-expert routing statistics of DeepSeek-V3 are at hand, so each MoE
layer's expert popularity is an assumption, Zipf(``--zipf``) over the 256 experts in a random
order per layer. Without EPLB rank ``r`` holds experts ``[r * 256 / EP, (r + 1) * 256 / EP)``;
with EPLB the placement is widellm's own planner (``eplb.planner.rebalance_experts``) on that
load with at least 32 redundant experts (as many more as make the slots divide by EP). Where
256 does not divide by EP (72, 144), "without EPLB" has the fewest redundant slots that make it
divide, placed by the planner for a uniform load (a static placement). Each
layer is priced with its own per-rank loads (the slowest rank sets the lockstep) and the step
is the mean over ``--layers`` sampled layers.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from widellm.eplb.planner import balancedness, identity_placement, rank_load, rebalance_experts
from widellm.sim import links
from widellm.sim.cost_model import make_cost_model
from widellm.sim.hardware import H200
from widellm.sim.known_models import DEEPSEEK_V3
from widellm.sim.types import DeploymentShape, RankStepLoad

EP_SIZES = (8, 16, 32, 64, 72, 144)
EXPERTS = 256
TOP_K = 8
SEQS_PER_RANK = 256
CONTEXT = 3000
GPUS_PER_NODE = 8
MIN_REDUNDANT = 32
NUM_GROUPS = 8  # DeepSeek-V3's n_group


def _redundant(ep: int, eplb: bool) -> int:
    """Redundant slots: at least 32 with EPLB, else only what makes the slots divide by EP."""
    extra = MIN_REDUNDANT if eplb else 0
    while (EXPERTS + extra) % ep:
        extra += 1
    return extra


def _layer_loads(zipf: float, layers: int, seed: int) -> torch.Tensor:
    """``[layers, EXPERTS]`` expert popularity (sums to 1 per layer)."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, EXPERTS + 1) ** zipf
    rows = [rng.permutation(base / base.sum()) for _ in range(layers)]
    return torch.tensor(np.stack(rows))


def _rank_shares(load: torch.Tensor, ep: int, eplb: bool) -> torch.Tensor:
    """``[layers, ep]`` share of the routed copies each rank computes."""
    layers = load.shape[0]
    slots = EXPERTS + _redundant(ep, eplb)
    nodes = max(1, ep // GPUS_PER_NODE)
    if eplb:
        p2l, _, count = rebalance_experts(load, slots, NUM_GROUPS, nodes, ep)
    elif slots == EXPERTS:
        p2l, _, count = identity_placement(layers, EXPERTS)
    else:  # a static placement that knows nothing of the load: planned for uniform load
        uniform = torch.ones_like(load)
        p2l, _, count = rebalance_experts(uniform, slots, NUM_GROUPS, nodes, ep)
    return rank_load(load, p2l, count, ep)


def _step_s(ep: int, shares: torch.Tensor, eplb: bool, dbo: bool) -> tuple[float, dict]:
    dep = DeploymentShape(num_ranks=ep, ranks_per_node=GPUS_PER_NODE,
                          all2all_backend="all2all_fixed", cuda_graphs=True,
                          num_redundant_experts=_redundant(ep, eplb))
    model = make_cost_model(DEEPSEEK_V3, H200, dep, weight_dtype="fp8")
    copies = SEQS_PER_RANK * TOP_K
    _, intra, inter = links.uniform_copies_split(copies, ep, GPUS_PER_NODE)
    local = (EXPERTS + dep.num_redundant_experts) // ep
    totals, parts = [], []
    for layer in shares:
        loads = [RankStepLoad(
            num_tokens=SEQS_PER_RANK, num_decode_tokens=SEQS_PER_RANK, num_seqs=SEQS_PER_RANK,
            attn_kv_read_tokens=SEQS_PER_RANK * CONTEXT,
            attn_score_pairs=SEQS_PER_RANK * CONTEXT,
            expert_recv_tokens=float(share) * copies * ep, active_local_experts=local,
            max_expert_tokens=float(share) * copies * ep / local,
            sent_intra_node=intra, sent_inter_node=inter) for share in layer]
        costs = model.step(loads, split=dbo)
        totals.append(costs[0].total_s)
        parts.append(max(costs, key=lambda c: c.breakdown["expert_gemm"]).breakdown)
    mean = statistics.fmean(totals)
    breakdown = {k: statistics.fmean(p[k] for p in parts) for k in parts[0]}
    return mean, breakdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zipf", type=float, default=0.5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    load = _layer_loads(args.zipf, args.layers, args.seed)
    print(f"DeepSeek-V3 decode, H200, {SEQS_PER_RANK} seqs/rank, context {CONTEXT}, "
          f"expert popularity Zipf({args.zipf}), {args.layers} layers sampled")
    print("| EP | balancedness off / EPLB | tok/s/GPU plain | EPLB | DBO | EPLB + DBO | "
          "all-to-all / step, plain (EPLB + DBO: exposed) | step ms plain / EPLB + DBO |")
    print("|---:|---|---:|---:|---:|---:|---|---|")
    for ep in EP_SIZES:
        cells, shares = {}, {}
        for eplb in (False, True):
            shares[eplb] = _rank_shares(load, ep, eplb)
            for dbo in (False, True):
                cells[eplb, dbo] = _step_s(ep, shares[eplb], eplb, dbo)
        bal = [float(balancedness(shares[e]).mean()) for e in (False, True)]
        plain_s, plain = cells[False, False]
        best_s, best = cells[True, True]
        comm = (plain["dispatch"] + plain["combine"]) / plain_s
        exposed = best["exposed_comm"] / best_s
        tps = [SEQS_PER_RANK / cells[k][0] for k in
               ((False, False), (True, False), (False, True), (True, True))]
        print(f"| {ep} | {bal[0]:.2f} / {bal[1]:.2f} | " + " | ".join(f"{t:,.0f}" for t in tps)
              + f" | {comm:.0%} ({exposed:.0%}) | {plain_s * 1e3:.1f} / {best_s * 1e3:.1f} |")


if __name__ == "__main__":
    main()
