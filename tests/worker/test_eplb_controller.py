"""The EPLB controller on real expert-parallel MoE layers (gloo ranks): a skewed load makes
it re-plan and move weights one layer per step while forwards keep running; every forward's
output equals all experts computed on one rank; and a move that fails on one rank leaves that
layer's (and the later layers') old placement in force on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_ranks
from widellm.config import EPLBConfig
from widellm.distributed.ep_context import ExpertParallelContext
from widellm.eplb.placement import ExpertPlacement
from widellm.layers.moe import LocalDispatcher, reference_experts_forward
from widellm.layers.moe.layer import FusedMoE
from widellm.eplb import collectives
from widellm.worker.eplb_controller import EplbController

NUM_EXPERTS = 8
REDUNDANT = 2 * 2  # divisible by 2 and 4 ranks with the 8 experts
TOP_K = 2
HIDDEN, INTER = 16, 8
NUM_LAYERS = 2
TOKENS = 12
STEPS = 10
WINDOW, INTERVAL = 2, 4
TIMEOUT_S = 90.0
HOT = [4, 5]


def _weights(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + layer)
    return (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=g),
            torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g))


def _reference(x: torch.Tensor, logits: torch.Tensor, layer: FusedMoE, index: int) -> torch.Tensor:
    """All experts local: the routing of ``layer`` (logical ids) and the plain expert loop."""
    from widellm.layers.moe.router import select_experts

    weights, ids = select_experts(logits, TOP_K, scoring_func="softmax", renormalize=True)
    local = LocalDispatcher(torch.arange(NUM_EXPERTS))
    handle = local.dispatch_launch(x, ids, weights)
    tokens = local.dispatch_wait(handle)
    w13, w2 = _weights(index)
    out = reference_experts_forward(tokens.hidden_states, tokens.expert_ids, w13, w2)
    return local.combine_wait(local.combine_launch(out, handle))


def _run(rank: int, world_size: int, fail_layer: int | None) -> dict:
    ep = ExpertParallelContext(rank, world_size, dist.group.WORLD, "all2all", None, 64, 16,
                               num_redundant_experts=REDUNDANT, enable_eplb=True)
    layers = []
    for i in range(NUM_LAYERS):
        moe = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTER, renormalize=True,
                       dtype=torch.float32, ep=ep)
        w13, w2 = _weights(i)
        for e in range(NUM_EXPERTS):
            moe.weight_loader("w13_weight", w13[e, :INTER], e, "w1")
            moe.weight_loader("w13_weight", w13[e, INTER:], e, "w3")
            moe.weight_loader("w2_weight", w2[e], e, "w2")
        layers.append(moe)
    config = EPLBConfig(enable_eplb=True, num_redundant_experts=REDUNDANT,
                        window_size=WINDOW, step_interval=INTERVAL)
    controller = EplbController(layers, config, rank, world_size, 1, dist.group.WORLD)
    if fail_layer is not None and rank == world_size - 1:
        real = collectives.prepare_layer_move

        def flaky(weights, plan, r):
            if weights[0].data_ptr() == layers[fail_layer].w13_weight.data_ptr():
                raise MemoryError("injected failure")  # e.g. no room for the new weights
            return real(weights, plan, r)

        collectives.prepare_layer_move = flaky  # this rank's process only
    gen = torch.Generator().manual_seed(rank)
    max_err = 0.0
    for _ in range(STEPS):
        controller.before_forward()
        x = torch.randn(TOKENS, HIDDEN, generator=gen)
        logits = torch.randn(TOKENS, NUM_EXPERTS, generator=gen)
        # Experts 4 and 5 are hot: the initial placement keeps them (and their first
        # replicas) on one rank, at 2 and at 4 ranks.
        logits[:, HOT] += 4.0
        for i, moe in enumerate(layers):
            got, ref = moe(x, logits), _reference(x, logits, moe, i)
            # Relative to the output's scale: ranks add their partial sums in another order.
            max_err = max(max_err, float((got - ref).abs().max() / ref.abs().max()))
    return {"max_err": max_err, "stats": controller.stats,
            "p2l": [m.placement.phys_to_logical.tolist() for m in layers]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_rebalance_moves_weights_and_outputs_stay_exact(world_size):
    results = run_ranks(_run, world_size, None, timeout_s=TIMEOUT_S)
    initial = ExpertPlacement.initial(NUM_EXPERTS, NUM_EXPERTS + REDUNDANT,
                                      world_size).phys_to_logical.tolist()
    for r in results:
        assert r["max_err"] < 1e-5
        assert r["stats"].num_rebalances >= 1 and r["stats"].num_failed_rebalances == 0
        assert r["stats"].initial_balancedness < 0.7 < r["stats"].balancedness
        assert r["p2l"] == results[0]["p2l"]  # every rank switched to the same placement
        assert r["p2l"][0] != initial
        # The hot experts got replicas.
        assert all(r["p2l"][0].count(e) >= 2 for e in HOT)


def test_failed_move_keeps_old_placement_everywhere():
    results = run_ranks(_run, 2, 1, timeout_s=TIMEOUT_S)
    initial = ExpertPlacement.initial(NUM_EXPERTS, NUM_EXPERTS + REDUNDANT,
                                      2).phys_to_logical.tolist()
    for r in results:
        assert r["max_err"] < 1e-5
        assert r["stats"].num_failed_rebalances >= 1
        assert r["p2l"] == results[0]["p2l"]
        assert r["p2l"][1] == initial  # the layer whose move failed never switched
        assert r["p2l"][0] != initial  # the layer moved before the failure did
