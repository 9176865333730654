"""The per-step lockstep vote on gloo ranks: flags are any-of, row counts come back per rank,
a split needs no NO vote and some DECODE or PREFILL (a dummy's FOLLOW never vetoes), and the
previous forward's time comes back as the slowest rank's."""

from __future__ import annotations

import torch.distributed as dist

from tests.dist_utils import run_ranks
from widellm.distributed.lockstep import DPLockstep, SplitVote, StepAgreement
from widellm.forward_context import DPMetadata

RUN_TIMEOUT_S = 60
NO, DECODE, PREFILL, FOLLOW = SplitVote.NO, SplitVote.DECODE, SplitVote.PREFILL, SplitVote.FOLLOW
# Per step, per rank: (has_work, shutdown, rows, split vote, previous forward's us).
VOTES = (
    ((True, False, 37, DECODE, 0), (False, False, 1, FOLLOW, 0), (False, False, 1, FOLLOW, 0)),
    ((False, False, 1, FOLLOW, 900), (False, False, 1, FOLLOW, 1200), (False, False, 1, NO, 0)),
    ((True, False, 2048, PREFILL, 0), (True, False, 5, DECODE, 7), (False, True, 1, FOLLOW, 0)),
    ((True, False, 64, DECODE, 0), (True, False, 1, NO, 0), (False, False, 1, FOLLOW, 0)),
)


def _rank_votes(rank: int, world_size: int) -> list[StepAgreement]:
    lockstep = DPLockstep(dist.group.WORLD)
    return [lockstep.sync(*step[rank]) for step in VOTES]


def test_every_rank_gets_the_same_agreement():
    expected = [
        StepAgreement(True, False, DPMetadata((37, 1, 1)), split=True),
        StepAgreement(False, False, DPMetadata((1, 1, 1)), last_forward_us=1200),
        StepAgreement(True, True, DPMetadata((2048, 5, 1)), split=True, any_prefill=True,
                      last_forward_us=7),
        StepAgreement(True, False, DPMetadata((64, 1, 1))),
    ]
    for got in run_ranks(_rank_votes, 3, timeout_s=RUN_TIMEOUT_S):
        assert got == expected
    assert expected[2].dp_metadata.max_num_tokens == 2048
