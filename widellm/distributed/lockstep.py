"""Lockstep of data-parallel ranks under expert parallelism.

Every MoE layer is a collective over all ranks, so each rank must run one forward per step
(a dummy batch when it has no work). Before each step the ranks exchange one vote each, in one
all-gather on the CPU group: "I have work", "I was told to shut down", and the rows of the
forward this rank will run (its scheduled and padded tokens, or the dummy batch's). They step
while any has work and stop together when any is shutting down; every MoE layer of the step
reads the agreed row counts from the forward context, so no layer agrees on sizes again.

Idle ranks keep calling this at a short interval, so a rank that gets a request pulls the
others in at the next call without any wake-up message (and no "wave" bookkeeping that a late
message could leave one rank waiting on its own).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from widellm.distributed.collectives import all_gather_single
from widellm.forward_context import DPMetadata

# One vote: [has_work, shutdown, num_tokens].
_VOTE_FIELDS = 3


class StepAgreement(NamedTuple):
    any_has_work: bool
    any_shutdown: bool
    # What every layer of this step's forward may rely on about the other ranks.
    dp_metadata: DPMetadata


class DPLockstep:
    def __init__(self, cpu_group: dist.ProcessGroup) -> None:
        self.cpu_group = cpu_group
        self.size = dist.get_world_size(cpu_group)
        self._vote = torch.zeros(_VOTE_FIELDS, dtype=torch.int64)
        # Flat: gloo's all-gather wants the output as one run of equal-size pieces.
        self._votes = torch.zeros(self.size * _VOTE_FIELDS, dtype=torch.int64)

    def sync(self, has_work: bool, shutdown: bool, num_tokens: int) -> StepAgreement:
        """Collective: every rank must call it once per loop iteration.

        Args:
            has_work: this rank has unfinished requests.
            shutdown: this rank was told to stop.
            num_tokens: rows of the forward this rank runs if the ranks step.
        """
        self._vote[0], self._vote[1], self._vote[2] = int(has_work), int(shutdown), num_tokens
        all_gather_single(self._votes, self._vote, group=self.cpu_group)
        votes = self._votes.view(self.size, _VOTE_FIELDS).tolist()
        return StepAgreement(
            any_has_work=any(v[0] for v in votes),
            any_shutdown=any(v[1] for v in votes),
            dp_metadata=DPMetadata(tuple(v[2] for v in votes)),
        )
