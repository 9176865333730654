"""``all2all_fixed`` sized per step: a call whose ranks agreed their token counts moves blocks
of ``step_capacity`` rows (enough for the largest rank) instead of the whole capacity, with the
same outputs as the whole-capacity exchange and the single-rank reference, on 2 and 4 gloo
ranks (a rank with no tokens, skewed routing, a capacity too small that still spills)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.layers.test_moe_dispatch_ep import (
    FP32_TOL, NUM_EXPERTS, ROUTES, RUN_TIMEOUT_S, SCENARIOS, TOP_K, _batch, _check_received,
    _ep_expert_map, _expert_weights, _reference,
)
from widellm.layers.moe import make_dispatcher, reference_experts_forward
from widellm.layers.moe.dispatch_all2all_fixed import step_capacity

# Whole-buffer capacities: roomy (a decode buffer for 64 sequences of the test's top-k), and
# one too small for the skewed batches, which then spill past it.
ROOMY = 64 * TOP_K
SMALL = 2


@pytest.mark.parametrize("capacity, max_tokens, rows_per_token, expected", [
    (1536, 20, 6, 192),  # 20 tokens -> 32, x 6 rows
    (1536, 32, 6, 192),
    (1536, 33, 6, 384),
    (1536, 256, 6, 1536),  # the whole buffer
    (1536, 300, 6, 1536),  # more than it holds: the whole buffer (the caller's check spills)
    (1536, None, 6, 1536),  # counts not agreed
    (1536, 1, 6, 6),
    (1536, 0, 6, 6),  # every rank idle: one token's worth, never an empty exchange
    (8, 3, 2, 8),
])
def test_step_capacity(capacity, max_tokens, rows_per_token, expected):
    assert step_capacity(capacity, max_tokens, rows_per_token) == expected


def _rank_sized_per_step(rank: int, world_size: int) -> list[int]:
    """Per routing and capacity: the call's block rows (per step), after checking that the
    per-step and whole-capacity exchanges give the reference's output."""
    per_rank = NUM_EXPERTS // world_size
    w13, w2 = _expert_weights(torch.float32)
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    rows = []
    for capacity in (ROOMY, SMALL):
        for route in ROUTES:
            counts = SCENARIOS[world_size][route][0]
            batches = [_batch(world_size, route, r, torch.float32) for r in range(world_size)]
            outs = []
            for per_step in (True, False):
                dispatcher = make_dispatcher("all2all_fixed", _ep_expert_map(rank, world_size),
                                             group=None, capacity=capacity,
                                             size_per_step=per_step)
                handle = dispatcher.dispatch_launch(*batches[rank], counts)
                tokens = dispatcher.dispatch_wait(handle)
                _check_received(tokens, batches, rank, per_rank)
                out = reference_experts_forward(tokens.hidden_states, tokens.expert_ids,
                                                w13[local], w2[local])
                outs.append(dispatcher.combine_wait(dispatcher.combine_launch(out, handle)))
                if per_step:
                    rows.append(handle.capacity)
                    assert handle.recv.shape[0] == world_size * handle.capacity
                else:
                    assert handle.capacity == capacity
            torch.testing.assert_close(outs[0], _reference(batches[rank], w13, w2), **FP32_TOL)
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    return rows


@pytest.mark.parametrize("world_size", [2, 4])
def test_per_step_blocks_match_the_whole_capacity(world_size):
    got = run_ranks(_rank_sized_per_step, world_size, timeout_s=RUN_TIMEOUT_S)
    rows_per_token = min(TOP_K, NUM_EXPERTS // world_size)
    expected = [step_capacity(capacity, max(SCENARIOS[world_size][route][0]), rows_per_token)
                for capacity in (ROOMY, SMALL) for route in ROUTES]
    # E.g. 2 ranks, random routing (11 and 0 tokens), 3 rows per token: 16 x 3 = 48 of 192.
    assert expected[:2] == ([48, 48] if world_size == 2 else [32, 32])
    assert expected[2:] == [SMALL, SMALL]
    assert got == [expected] * world_size
