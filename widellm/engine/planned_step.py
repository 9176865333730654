"""A lockstep rank's next step as it stands between scheduling and the ranks' vote."""

from __future__ import annotations

import dataclasses

from widellm.core.scheduler_output import SchedulerOutput
from widellm.worker.model_runner import DUMMY_BATCH_ROWS, ModelInput


@dataclasses.dataclass
class PlannedStep:
    """A lockstep rank's next step, scheduled and prepared before the ranks vote on it.

    Attributes:
        scheduler_output: what the scheduler chose; None when this rank has no request (it
            runs a dummy batch if the ranks step).
        model_input: the forward's inputs; None when nothing was scheduled.
    """

    scheduler_output: SchedulerOutput | None
    model_input: ModelInput | None

    @property
    def has_work(self) -> bool:
        return self.scheduler_output is not None

    @property
    def num_rows(self) -> int:
        """Rows of the forward this rank runs if the ranks step (its vote)."""
        return self.model_input.num_rows if self.model_input is not None else DUMMY_BATCH_ROWS
