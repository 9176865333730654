"""The lockstep rule is one pure function, ``lockstep.decide``: the engine's ``DPLockstep``
applies it to the votes its all-gather collected, the simulator to the votes of its
in-process ranks. A table of votes -> agreements, and checks that both callers use it."""

from __future__ import annotations

import pytest
import torch

import widellm.distributed.lockstep as lockstep
from widellm.distributed.lockstep import DPLockstep, SplitVote, StepAgreement, Vote, decide
from widellm.forward_context import DPMetadata

NO, DECODE, PREFILL, FOLLOW = SplitVote.NO, SplitVote.DECODE, SplitVote.PREFILL, SplitVote.FOLLOW

TABLE = [
    # one rank has work: the others run dummies and follow its split
    ([Vote(True, False, 37, DECODE), Vote(False, False, 1, FOLLOW)],
     StepAgreement(True, False, DPMetadata((37, 1)), split=True)),
    # nobody has work: idle; the slowest previous forward still comes back
    ([Vote(False, False, 1, FOLLOW, 900), Vote(False, False, 1, NO, 1200)],
     StepAgreement(False, False, DPMetadata((1, 1)), last_forward_us=1200)),
    # one rank shuts down: all do; a prefill vote marks the step
    ([Vote(True, False, 2048, PREFILL), Vote(True, False, 5, DECODE, 7),
      Vote(False, True, 1, FOLLOW)],
     StepAgreement(True, True, DPMetadata((2048, 5, 1)), split=True, any_prefill=True,
                   last_forward_us=7)),
    # any NO vetoes the split
    ([Vote(True, False, 64, DECODE), Vote(True, False, 1, NO)],
     StepAgreement(True, False, DPMetadata((64, 1)))),
    # only followers: nobody asked to split
    ([Vote(False, False, 1, FOLLOW), Vote(False, False, 1, FOLLOW)],
     StepAgreement(False, False, DPMetadata((1, 1)))),
    # one rank alone
    ([Vote(True, False, 3)], StepAgreement(True, False, DPMetadata((3,)))),
]


@pytest.mark.parametrize("votes,expected", TABLE)
def test_decide_table(votes, expected):
    assert decide(votes) == expected


def test_dplockstep_sync_applies_decide(monkeypatch):
    """DPLockstep.sync turns the gathered rows into Votes and hands them to ``decide``."""
    peer = [1, 0, 64, int(DECODE), 500]

    def fake_all_gather(out, vote, group=None):  # two ranks: this one, then a peer
        out.copy_(torch.cat([vote, torch.tensor(peer)]))

    seen = []

    def spy(votes):
        seen.append(list(votes))
        return decide(votes)

    monkeypatch.setattr(lockstep, "all_gather_single", fake_all_gather)
    monkeypatch.setattr(lockstep, "decide", spy)
    monkeypatch.setattr(lockstep.dist, "get_world_size", lambda group: 2)
    got = DPLockstep(None).sync(True, False, 37, DECODE, 100)
    assert seen == [[Vote(True, False, 37, DECODE, 100), Vote(True, False, 64, DECODE, 500)]]
    assert got == StepAgreement(True, False, DPMetadata((37, 64)), split=True,
                                last_forward_us=500)


def test_simulator_uses_the_same_function():
    import widellm.sim.pool as pool

    assert pool.decide is lockstep.decide
