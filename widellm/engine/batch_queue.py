"""Async scheduling on a rank that steps on its own (no lockstep vote): the loop schedules
step N+1, with placeholders for N's samples, while the engine core's runner thread executes N.

The runner thread executes steps in order and feeds N's sampled tokens into N+1 itself, so
outputs equal synchronous scheduling. A second step is scheduled only behind a decode-only
step: scheduled behind a prompt step, it would miss what arrives while that long step runs
(a burst's prefill split over more steps). Lockstep ranks pipeline their voted steps in
:mod:`widellm.engine.lockstep_pipeline` instead.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

from widellm.core.outputs import EngineCoreOutput, ModelRunnerOutput
from widellm.core.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from widellm.engine.engine_core import EngineCore

# Steps in flight: the one running and the one scheduled behind it.
MAX_STEPS_IN_FLIGHT = 2
# A step's result: (start, end, output), times on the engine core's clock.
_Timed = tuple[float, float, ModelRunnerOutput]


class BatchQueue:
    """The steps an engine core has submitted to its runner thread, oldest first; each is
    counted as a step (``EngineCore.count_step``) when its result is collected, timed from
    when the runner thread began it."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.in_flight: deque[tuple[SchedulerOutput, Future[_Timed]]]
        self.in_flight = deque()

    def __len__(self) -> int:
        return len(self.in_flight)

    def step(self) -> list[EngineCoreOutput]:
        """Submit the next step where there is room, then collect the oldest one; returns []
        without waiting while it fills the pipeline behind a decode-only step."""
        core = self.core
        behind_prompt = bool(self.in_flight) and self.in_flight[-1][0].has_prompt_tokens
        if len(self.in_flight) < MAX_STEPS_IN_FLIGHT and not behind_prompt:
            so = core.schedule_step()
            # An empty step still goes through the runner thread when it carries finished or
            # preempted ids: the runner must drop their state, in order.
            if so is not None and (not so.is_empty or so.finished_req_ids
                                   or so.preempted_req_ids):
                self.in_flight.append((so, core.runner_thread.submit(self._execute, so)))
                if (len(self.in_flight) < MAX_STEPS_IN_FLIGHT and not so.is_empty
                        and not so.has_prompt_tokens):
                    return []
        if not self.in_flight:
            return []
        so, future = self.in_flight.popleft()
        start, end, runner_output = future.result()
        try:
            return core.finish_step(so, runner_output)
        finally:
            core.count_step(start, end)

    def _execute(self, so: SchedulerOutput) -> _Timed:
        """On the runner thread: the step's start and end there, and its output (its end is
        not when it is collected: by then the step behind it may be running)."""
        start = self.core.clock()
        output = self.core.model_runner.execute_model(so)
        return start, self.core.clock(), output
