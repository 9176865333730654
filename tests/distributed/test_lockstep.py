"""The per-step lockstep vote on gloo ranks: flags are any-of, row counts come back per rank."""

from __future__ import annotations

import torch.distributed as dist

from tests.dist_utils import run_ranks
from widellm.distributed.lockstep import DPLockstep, StepAgreement
from widellm.forward_context import DPMetadata

RUN_TIMEOUT_S = 60
# Per step, per rank: (has_work, shutdown, rows).
VOTES = (
    ((True, False, 37), (False, False, 1), (False, False, 1)),
    ((False, False, 1), (False, False, 1), (False, False, 1)),
    ((True, False, 2048), (True, False, 5), (False, True, 1)),
)


def _rank_votes(rank: int, world_size: int) -> list[StepAgreement]:
    lockstep = DPLockstep(dist.group.WORLD)
    return [lockstep.sync(*step[rank]) for step in VOTES]


def test_every_rank_gets_the_same_agreement():
    expected = [
        StepAgreement(True, False, DPMetadata((37, 1, 1))),
        StepAgreement(False, False, DPMetadata((1, 1, 1))),
        StepAgreement(True, True, DPMetadata((2048, 5, 1))),
    ]
    for got in run_ranks(_rank_votes, 3, timeout_s=RUN_TIMEOUT_S):
        assert got == expected
    assert expected[2].dp_metadata.max_num_tokens == 2048
