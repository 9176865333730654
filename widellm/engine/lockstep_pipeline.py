"""Async scheduling on lockstep (expert-parallel) ranks: one thread owns the rank's collectives.

A lockstep rank issues three kinds of collectives: the per-step vote, the forward's MoE
dispatch/combine (of a real or a dummy batch) and EPLB's weight moves. Ranks pair them by
order, so they must be issued by one thread in one order on every rank. Here that thread is
the engine core's runner thread, and each job it runs is a :class:`VotedStep`: apply the
scheduler output and build the forward inputs (after the previous step has sampled, so its
tokens feed this one without a round trip), vote, then run the forward the vote asks for.
Every job votes exactly once, so ranks that submit jobs at different rates still pair vote k
with vote k; the scheduling thread never touches a process group.

Once a vote agrees to shut down, every later job of the rank returns without a collective: the
other ranks stop voting at the same vote, and a job already queued behind it must not wait for
a partner that will never come (vllm#28774 is that hang for an early-returning empty step).

Timeline on one rank, two steps in flight behind decode-only steps (S = schedule on the loop
thread, R = a job on the runner thread: prepare, vote, forward, sample; behind a step with
prompt tokens the next is scheduled once that one ran, see :attr:`LockstepPipeline.full`)::

    loop:   S1 S2 ...wait R1... U1 S3 ...wait R2... U2 S4
    runner:    [----R1-----]   [----R2-----][----R3-----]
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from collections import deque

from widellm.core.outputs import ModelRunnerOutput
from widellm.core.scheduler_output import SchedulerOutput
from widellm.distributed.lockstep import DPLockstep, StepAgreement
from widellm.engine.batch_queue import MAX_STEPS_IN_FLIGHT
from widellm.engine.engine_core import EngineCore
from widellm.step_timer import maybe_phase


@dataclasses.dataclass
class VotedStep:
    """A job's result.

    Attributes:
        scheduler_output: what this rank scheduled (None: it had no request).
        agreement: the ranks' vote (None after the ranks agreed to shut down).
        runner_output: the samples of this rank's forward (None: no forward of its own).
        start: when the job began (for the step's duration).
    """

    scheduler_output: SchedulerOutput | None
    agreement: StepAgreement | None
    runner_output: ModelRunnerOutput | None
    start: float

    @property
    def shutdown(self) -> bool:
        return self.agreement is None or self.agreement.any_shutdown


class LockstepPipeline:
    """The voted steps of one lockstep rank, queued on its engine core's runner thread.

    Args:
        core: the engine core (created with ``async_scheduling``, so it has a runner thread).
        lockstep: the rank's vote over the data-parallel CPU group.
    """

    def __init__(self, core: EngineCore, lockstep: DPLockstep) -> None:
        if core.runner_thread is None:
            raise ValueError("a lockstep pipeline needs the engine core's runner thread")
        self.core, self.lockstep = core, lockstep
        self.in_flight: deque[Future[VotedStep]] = deque()
        self._agreed_shutdown = False  # written and read on the runner thread only
        self._last_has_prompt = False  # the last submitted step carries prompt tokens

    @property
    def full(self) -> bool:
        """No room for another step: two in flight, or the last one carries prompt tokens. A
        step scheduled behind a prompt step would miss what arrives while that long step runs;
        at the start of a burst one rank would then prefill part of it a step later than
        another, and the ranks would wait for each other's prefill in turn."""
        return (len(self.in_flight) >= MAX_STEPS_IN_FLIGHT
                or bool(self.in_flight) and self._last_has_prompt)

    def submit(self, so: SchedulerOutput | None, shutdown_requested: bool) -> None:
        """Queue one voted step for what the scheduler chose (None: a vote without work)."""
        self.in_flight.append(self.core.runner_thread.submit(self._run, so, shutdown_requested))
        self._last_has_prompt = so is not None and so.has_prompt_tokens

    def collect(self) -> VotedStep:
        """The oldest step's result, waiting for it (re-raises the runner thread's error)."""
        return self.in_flight.popleft().result()

    def _run(self, so: SchedulerOutput | None, shutdown_requested: bool) -> VotedStep:
        start = self.core.clock()
        if self._agreed_shutdown:
            return VotedStep(so, None, None, start)
        core = self.core
        step = core.prepare_step(so)
        with maybe_phase(core.step_timer, "lockstep_sync"):
            agreement = core.vote_step(self.lockstep, step, shutdown_requested)
        if agreement.any_shutdown:
            self._agreed_shutdown = True
            return VotedStep(so, agreement, None, start)
        if not agreement.any_has_work:
            return VotedStep(so, agreement, None, start)
        return VotedStep(so, agreement, core.forward_planned_step(step, agreement), start)
