"""Logical -> physical expert ids: exact mapping, padding, and even spread over replicas."""

from __future__ import annotations

import pytest
import torch

from widellm.eplb.planner import rebalance_experts
from widellm.eplb.routing import logical_to_physical_ids

# 4 experts on 7 slots: e0 on slots 0, 2, 4; e1 on 1; e2 on 3, 5; e3 on 6.
LOGICAL_TO_PHYS = torch.tensor([[0, 2, 4], [1, -1, -1], [3, 5, -1], [6, -1, -1]])
REPLICA_COUNT = torch.tensor([3, 1, 2, 1])
TOPK_IDS = torch.tensor([[0, 2], [0, 1], [-1, -1], [2, 0], [3, 0]])


def test_exact_small_case():
    # Token-major selections and their occurrence index per expert:
    #   t0: e0#0 -> replica 0 -> slot 0, e2#0 -> slot 3
    #   t1: e0#1 -> slot 2,             e1#0 -> slot 1
    #   t2: padding stays -1
    #   t3: e2#1 -> slot 5,             e0#2 -> slot 4
    #   t4: e3#0 -> slot 6,             e0#3 -> 3 mod 3 = replica 0 -> slot 0
    physical = logical_to_physical_ids(TOPK_IDS, LOGICAL_TO_PHYS, REPLICA_COUNT)
    assert physical.tolist() == [[0, 3], [2, 1], [-1, -1], [5, 4], [6, 0]]
    assert physical.dtype == TOPK_IDS.dtype


def test_offset_rotates_replicas():
    # Offset 1: e0's selections take replicas 1, 2, 0, 1; e2's take 1, 0.
    physical = logical_to_physical_ids(TOPK_IDS, LOGICAL_TO_PHYS, REPLICA_COUNT, offset=1)
    assert physical.tolist() == [[2, 5], [4, 1], [-1, -1], [3, 0], [6, 2]]


def test_padding_preserved_and_dtype_kept():
    ids = torch.tensor([[-1, 3], [1, -1]], dtype=torch.int32)
    physical = logical_to_physical_ids(ids, LOGICAL_TO_PHYS, REPLICA_COUNT)
    assert physical.tolist() == [[-1, 6], [1, -1]]
    assert physical.dtype == torch.int32
    empty = torch.empty(0, 2, dtype=torch.int64)
    assert logical_to_physical_ids(empty, LOGICAL_TO_PHYS, REPLICA_COUNT).shape == (0, 2)


@pytest.mark.parametrize("offset", [0, 5])
def test_hot_expert_spread_evenly(offset):
    # A realistic plan: expert 0 is hot and gets several replicas. Tokens pick it at random
    # (not every token, and not every other token), so token index mod count would not be even.
    num_logical, num_slots, top_k, num_tokens = 16, 24, 4, 997
    load = torch.ones(1, num_logical)
    load[0, 0] = 40.0
    phys_to_logical, logical_to_phys, count = rebalance_experts(load, num_slots, 4, 2, 4)
    assert int(count[0, 0]) >= 3
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(num_tokens, num_logical, generator=gen)
    scores[:, 0] += (torch.rand(num_tokens, generator=gen) < 0.6).float()  # e0 in ~60% of tokens
    topk_ids = scores.topk(top_k, dim=1).indices
    topk_ids[torch.rand(num_tokens, generator=gen) < 0.1] = -1  # some padding rows
    physical = logical_to_physical_ids(topk_ids, logical_to_phys[0], count[0], offset=offset)

    assert torch.equal(physical < 0, topk_ids < 0)
    valid = physical >= 0
    # Every selection lands on a slot holding its expert.
    assert torch.equal(phys_to_logical[0][physical[valid]], topk_ids[valid])
    # Each expert's selections split over its replicas with counts differing by at most 1.
    tokens_per_slot = torch.bincount(physical[valid], minlength=num_slots)
    for expert in range(num_logical):
        replicas = logical_to_phys[0, expert, : int(count[0, expert])]
        per_replica = tokens_per_slot[replicas]
        assert int(per_replica.max() - per_replica.min()) <= 1
    hot = tokens_per_slot[logical_to_phys[0, 0, : int(count[0, 0])]]
    assert int(hot.sum()) > 400  # the hot expert really was hot


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_same_result_on_gpu():
    on_gpu = logical_to_physical_ids(TOPK_IDS.cuda(), LOGICAL_TO_PHYS.cuda(), REPLICA_COUNT.cuda())
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), logical_to_physical_ids(TOPK_IDS, LOGICAL_TO_PHYS, REPLICA_COUNT))
