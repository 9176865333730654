"""The EPLB controller on real expert-parallel MoE layers (gloo ranks): a skewed load makes
it re-plan and move weights one layer per step while forwards keep running; every forward's
output equals all experts computed on one rank (also with FP8 experts, whose block scales
move with their weights); and a move that fails on one rank leaves that layer's (and the
later layers') old placement in force on every rank. Offline EPLB: a run saves exactly the
load it routed, and a run started from a recorded load begins on the planner's placement."""

from __future__ import annotations

import json

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
from widellm.layers.linear_fp8 import dequantize_blocks
from widellm.layers.moe.experts_fp8 import use_fp8_experts
from widellm.model.fp8 import quantize_weight_block_fp8
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
# FP8 experts: one 128 x 128 scale block per projection half (up's rows start a block).
FP8_BLOCK = (128, 128)
FP8_HIDDEN = FP8_INTER = 128


def _sizes(fp8: bool) -> tuple[int, int]:
    return (FP8_HIDDEN, FP8_INTER) if fp8 else (HIDDEN, INTER)


def _weights(layer: int, fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``; with ``fp8``, the values the FP8 blocks
    hold (quantized, then dequantized), so the reference computes what the layer does."""
    hidden, inter = _sizes(fp8)
    g = torch.Generator().manual_seed(100 + layer)
    w13 = torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=g)
    w2 = torch.randn(NUM_EXPERTS, hidden, inter, generator=g)
    if fp8:
        w13, w2 = (torch.stack([dequantize_blocks(*quantize_weight_block_fp8(w, FP8_BLOCK),
                                                  FP8_BLOCK) for w in ws]) for ws in (w13, w2))
    return w13, w2


def _load(moe: FusedMoE, index: int, fp8: bool) -> None:
    w13, w2 = _weights(index, fp8)
    inter = _sizes(fp8)[1]
    for e in range(NUM_EXPERTS):
        for name, w, shard in (("w13_weight", w13[e, :inter], "w1"),
                               ("w13_weight", w13[e, inter:], "w3"), ("w2_weight", w2[e], "w2")):
            if not fp8:
                moe.weight_loader(name, w, e, shard)
                continue
            q, scale = quantize_weight_block_fp8(w, FP8_BLOCK)
            moe.weight_loader(name, q, e, shard)
            moe.weight_loader(name + "_scale_inv", scale, e, shard)


def _reference(x: torch.Tensor, logits: torch.Tensor, layer: FusedMoE, index: int,
               fp8: bool = False) -> torch.Tensor:
    """All experts local: the routing of ``layer`` (logical ids) and the plain expert loop."""
    from widellm.layers.moe.router import select_experts

    weights, ids = select_experts(logits, TOP_K, scoring_func="softmax", renormalize=True)
    local = LocalDispatcher(torch.arange(NUM_EXPERTS))
    handle = local.dispatch_launch(x, ids, weights)
    tokens = local.dispatch_wait(handle)
    w13, w2 = _weights(index, fp8)
    out = reference_experts_forward(tokens.hidden_states, tokens.expert_ids, w13, w2)
    return local.combine_wait(local.combine_launch(out, handle))


def _inputs(rank: int, hidden: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's ``(x [TOKENS, hidden], router logits [TOKENS, E])`` on ``rank``."""
    gen = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(STEPS):
        x = torch.randn(TOKENS, hidden, generator=gen)
        logits = torch.randn(TOKENS, NUM_EXPERTS, generator=gen)
        # Experts 4 and 5 are hot: the initial placement keeps them (and their first
        # replicas) on one rank, at 2 and at 4 ranks.
        logits[:, HOT] += 4.0
        steps.append((x, logits))
    return steps


def _run(rank: int, world_size: int, fail_layer: int | None, fp8: bool = False,
         offline: dict | None = None) -> dict:
    ep = ExpertParallelContext(rank, world_size, dist.group.WORLD, "all2all", None, 64, 16,
                               num_redundant_experts=REDUNDANT, enable_eplb=True)
    hidden, inter = _sizes(fp8)
    layers = []
    for i in range(NUM_LAYERS):
        moe = FusedMoE(NUM_EXPERTS, TOP_K, hidden, inter, renormalize=True,
                       dtype=torch.float32, ep=ep)
        if fp8:  # kept FP8, computed by dequantizing per call (the CPU's kernel)
            use_fp8_experts(moe, [""], FP8_BLOCK, kernel="dequant")
        _load(moe, i, fp8)
        layers.append(moe)
    config = EPLBConfig(enable_eplb=True, num_redundant_experts=REDUNDANT,
                        window_size=WINDOW, step_interval=INTERVAL, **(offline or {}))
    controller = EplbController(layers, config, rank, world_size, 1, dist.group.WORLD)
    controller.place_from_recorded_load()
    start_p2l = [m.placement.phys_to_logical.tolist() for m in layers]
    if fail_layer is not None and rank == world_size - 1:
        real = collectives.prepare_layer_move

        def flaky(weights, plan, r):
            if weights[0].data_ptr() == layers[fail_layer].w13_weight.data_ptr():
                raise MemoryError("injected failure")  # e.g. no room for the new weights
            return real(weights, plan, r)

        collectives.prepare_layer_move = flaky  # this rank's process only
    max_err = 0.0
    for x, logits in _inputs(rank, hidden):
        controller.before_forward()
        for i, moe in enumerate(layers):
            got, ref = moe(x, logits), _reference(x, logits, moe, i, fp8)
            # Relative to the output's scale: ranks add their partial sums in another order.
            max_err = max(max_err, float((got - ref).abs().max() / ref.abs().max()))
    return {"max_err": max_err, "stats": controller.stats, "start_p2l": start_p2l,
            "p2l": [m.placement.phys_to_logical.tolist() for m in layers],
            "dtypes": {str(p.dtype) for m in layers for p in m.expert_parameters()}}


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


def test_fp8_experts_move_with_their_scales():
    """FP8 expert weights and their block scales move together: after rebalancing, every
    forward still equals the experts computed from the dequantized weights on one rank."""
    results = run_ranks(_run, 2, None, True, timeout_s=TIMEOUT_S)
    for r in results:
        assert r["dtypes"] == {"torch.float8_e4m3fn", "torch.float32"}
        assert r["max_err"] < 1e-5
        assert r["stats"].num_rebalances >= 1 and r["stats"].num_failed_rebalances == 0
        assert all(r["p2l"][0].count(e) >= 2 for e in HOT)


def test_save_path_records_exactly_the_routed_load(tmp_path):
    """``static`` never re-plans, so every window is measured: the file holds the top-k
    selections of every forward but the last (measured at steps 2, 4, .., 10, each window
    holding the forwards before it), in logical ids, summed over both ranks."""
    from widellm.eplb.load_file import load_expert_load
    from widellm.layers.moe.router import select_experts

    path = str(tmp_path / "load.json")
    results = run_ranks(_run, 2, None, False, {"save_path": path, "static": True},
                        timeout_s=TIMEOUT_S)
    initial = ExpertPlacement.initial(NUM_EXPERTS, NUM_EXPERTS + REDUNDANT,
                                      2).phys_to_logical.tolist()
    expected = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    for rank in range(2):
        for _, logits in _inputs(rank, HIDDEN)[:STEPS - 1]:
            _, ids = select_experts(logits, TOP_K, scoring_func="softmax", renormalize=True)
            expected += torch.bincount(ids.flatten(), minlength=NUM_EXPERTS)
    saved = load_expert_load(path, NUM_LAYERS, NUM_EXPERTS)
    assert saved.tolist() == [expected.tolist()] * NUM_LAYERS
    assert int(saved[0].sum()) == 2 * (STEPS - 1) * TOKENS * TOP_K
    with open(path) as f:
        assert json.load(f)["num_steps"] == STEPS - 1
    for r in results:
        assert r["stats"].num_rebalances == 0 and r["p2l"] == [initial] * NUM_LAYERS


def test_load_path_places_experts_before_the_first_step(tmp_path):
    """A recorded load with experts 4 and 5 hot: both ranks start on the planner's placement
    for it (the hot experts replicated), every forward is exact, and the first measured
    window is already balanced (below 0.7 without the file, see the rebalance test)."""
    from widellm.eplb.load_file import save_expert_load
    from widellm.eplb.planner import rebalance_experts

    recorded = torch.ones(NUM_LAYERS, NUM_EXPERTS, dtype=torch.int64)
    recorded[:, HOT] = 50
    path = str(tmp_path / "load.json")
    save_expert_load(path, recorded, TOP_K, 100)
    planned = rebalance_experts(recorded, NUM_EXPERTS + REDUNDANT, 1, 1, 2)[0].tolist()
    results = run_ranks(_run, 2, None, False, {"load_path": path, "static": True},
                        timeout_s=TIMEOUT_S)
    for r in results:
        assert r["start_p2l"] == planned == r["p2l"]
        assert all(planned[0].count(e) >= 2 for e in HOT)
        assert r["max_err"] < 1e-5
        assert r["stats"].num_rebalances == 0 and r["stats"].num_failed_rebalances == 0
        assert r["stats"].initial_balancedness > 0.8
