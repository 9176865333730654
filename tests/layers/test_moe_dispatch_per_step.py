"""``--all2all-backend auto`` on 2 gloo ranks: decode-sized calls go through the fixed-capacity
exchange, larger ones through the variable exchange, every rank choosing the same from the
agreed counts, and both give what the single-rank reference gives."""

from __future__ import annotations

import torch

from tests.dist_utils import run_ranks
from tests.layers.test_moe_dispatch_ep import (
    FP32_TOL, HIDDEN, NUM_EXPERTS, RUN_TIMEOUT_S, TOP_K, _ep_expert_map, _expert_weights,
    _reference, _run_layer,
)
from widellm.layers.moe import make_dispatcher, reference_experts_forward
from widellm.layers.moe.dispatch_all2all import All2AllDispatcher
from widellm.layers.moe.dispatch_all2all_fixed import FixedCapacityAll2AllDispatcher

WORLD = 2
DECODE_ROWS = 6
CAPACITY = DECODE_ROWS * TOP_K
# Rows per rank of each call: decode-sized on both ranks, then one rank over a decode step.
CALLS = ([5, 3], [6, 0], [11, 2])


def _rank_per_step(rank: int, world_size: int) -> list[tuple[str, int]]:
    dispatcher = make_dispatcher("auto", _ep_expert_map(rank, world_size), group=None,
                                 capacity=CAPACITY, max_tokens_per_rank=16,
                                 decode_rows=DECODE_ROWS)
    w13, w2 = _expert_weights(torch.float32)
    per_rank = NUM_EXPERTS // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    chosen = []
    for i, counts in enumerate(CALLS):
        gen = torch.Generator().manual_seed(100 * i + rank)
        n = counts[rank]
        scores = torch.rand(n, NUM_EXPERTS, generator=gen)
        weights, ids = scores.topk(TOP_K, dim=-1)
        batch = (torch.randn(n, HIDDEN, generator=gen), ids, weights)
        handle = dispatcher.dispatch_launch(*batch, counts)
        chosen.append(type(handle.backend).__name__)
        tokens = dispatcher.dispatch_wait(handle)
        out = reference_experts_forward(tokens.hidden_states, tokens.expert_ids, w13[local],
                                        w2[local])
        result = dispatcher.combine_wait(dispatcher.combine_launch(out, handle))
        torch.testing.assert_close(result, _reference(batch, w13, w2), **FP32_TOL)
        # And with the counts left to the dispatcher to agree (outside an engine step).
        _, again = _run_layer(dispatcher, batch, w13[local], w2[local])
        torch.testing.assert_close(again, result, **FP32_TOL)
    return chosen


def test_decode_calls_use_fixed_buffers_and_larger_ones_the_variable_exchange():
    got = run_ranks(_rank_per_step, WORLD, timeout_s=RUN_TIMEOUT_S)
    fixed, variable = FixedCapacityAll2AllDispatcher.__name__, All2AllDispatcher.__name__
    assert got == [[fixed, fixed, variable]] * WORLD
