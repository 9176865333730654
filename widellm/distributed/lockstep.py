"""Lockstep of data-parallel ranks under expert parallelism.

Every MoE layer is a collective over all ranks, so each rank must run one forward per step
(a dummy batch when it has no work). Before each step the ranks exchange one vote each, in one
all-gather on the CPU group: "I have work", "I was told to shut down", the rows of the forward
this rank will run (its scheduled and padded tokens, or the dummy batch's), whether its batch
is big enough to split into two micro-batches (dual-batch overlap), and how long its previous
forward took. They step while any has work and stop together when any is shutting down; every
MoE layer of the step reads the agreed row counts from the forward context, so no layer agrees
on sizes again; and they split a step only if no rank's batch is too small (a rank with a dummy
batch follows the others: vLLM lets any rank veto, but an idle rank has nothing to lose).

Idle ranks keep calling this at a short interval, so a rank that gets a request pulls the
others in at the next call without any wake-up message (and no "wave" bookkeeping that a late
message could leave one rank waiting on its own).
"""

from __future__ import annotations

from enum import IntEnum
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from widellm.distributed.collectives import all_gather_single
from widellm.forward_context import DPMetadata


class SplitVote(IntEnum):
    """A rank's say on running the step as two micro-batches."""

    NO = 0  # DBO off, or the batch is below its threshold
    DECODE = 1  # a batch of decodes only, at or above the decode threshold
    PREFILL = 2  # a batch with prompt tokens, at or above the prefill threshold
    FOLLOW = 3  # a dummy batch: splits when the others do


class StepAgreement(NamedTuple):
    any_has_work: bool
    any_shutdown: bool
    # What every layer of this step's forward may rely on about the other ranks.
    dp_metadata: DPMetadata
    # Every rank may split (no NO vote, at least one DECODE or PREFILL); a DBO policy may
    # still decline (auto), the same way on every rank.
    split: bool = False
    any_prefill: bool = False
    # The slowest rank's previous forward, in microseconds (0: there was none).
    last_forward_us: int = 0


class Vote(NamedTuple):
    """One rank's vote on the next step (see :meth:`DPLockstep.sync` for the fields)."""

    has_work: bool
    shutdown: bool
    num_tokens: int
    split_vote: SplitVote = SplitVote.NO
    last_forward_us: int = 0


# A vote on the wire: one int64 per field of Vote, in order.
_VOTE_FIELDS = len(Vote._fields)


def decide(votes: Sequence[Vote]) -> StepAgreement:
    """The ranks' agreement from their votes, in rank order: the one rule of the lockstep,
    used by :class:`DPLockstep` after its all-gather and by the simulator
    (``widellm/sim/pool.py``) on the votes of its in-process ranks."""
    splits = [SplitVote(v.split_vote) for v in votes]
    return StepAgreement(
        any_has_work=any(v.has_work for v in votes),
        any_shutdown=any(v.shutdown for v in votes),
        dp_metadata=DPMetadata(tuple(int(v.num_tokens) for v in votes)),
        split=(SplitVote.NO not in splits
               and any(s in (SplitVote.DECODE, SplitVote.PREFILL) for s in splits)),
        any_prefill=SplitVote.PREFILL in splits,
        last_forward_us=max(int(v.last_forward_us) for v in votes),
    )


class DPLockstep:
    def __init__(self, cpu_group: dist.ProcessGroup) -> None:
        self.cpu_group = cpu_group
        self.size = dist.get_world_size(cpu_group)
        self._vote = torch.zeros(_VOTE_FIELDS, dtype=torch.int64)
        # Flat: gloo's all-gather wants the output as one run of equal-size pieces.
        self._votes = torch.zeros(self.size * _VOTE_FIELDS, dtype=torch.int64)

    def sync(self, has_work: bool, shutdown: bool, num_tokens: int,
             split_vote: SplitVote = SplitVote.NO, last_forward_us: int = 0) -> StepAgreement:
        """Collective: every rank must call it once per loop iteration.

        Args:
            has_work: this rank has unfinished requests.
            shutdown: this rank was told to stop.
            num_tokens: rows of the forward this rank runs if the ranks step.
            split_vote: whether this rank's batch may run as two micro-batches.
            last_forward_us: how long this rank's previous forward took (0: none).
        """
        self._vote[:] = torch.tensor(
            [int(has_work), int(shutdown), num_tokens, int(split_vote), last_forward_us])
        all_gather_single(self._votes, self._vote, group=self.cpu_group)
        rows = self._votes.view(self.size, _VOTE_FIELDS).tolist()
        return decide([Vote(bool(v[0]), bool(v[1]), v[2], SplitVote(v[3]), v[4]) for v in rows])
