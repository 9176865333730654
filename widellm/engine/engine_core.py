"""The engine core: scheduler + model runner, stepping one batch at a time.

It owns the KV cache and request bookkeeping for one (data-parallel) rank and speaks only in
token ids: ``EngineCoreRequest`` in, ``EngineCoreOutput`` out.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from widellm.comm_trace import ExchangeLog, trace_dir
from widellm.compute_threads import init_compute_thread
from widellm.config import EngineConfig
from widellm.core.outputs import EngineCoreOutput, ModelRunnerOutput
from widellm.core.request import Request
from widellm.core.scheduler import Scheduler
from widellm.core.scheduler_stats import SchedulerStats
from widellm.core.scheduler_output import SchedulerOutput
from widellm.distributed.ep_context import ExpertParallelContext
from widellm.distributed.groups import DPGroups
from widellm.distributed.lockstep import DPLockstep, StepAgreement, Vote
from widellm.engine.batch_queue import BatchQueue
from widellm.engine.dbo_policy import DboPolicy
from widellm.engine.kv_budget import determine_num_blocks
from widellm.engine.planned_step import PlannedStep
from widellm.kv_transfer.registry import make_scheduler
from widellm.model.loader import load_eos_token_ids
from widellm.sampling_params import SamplingParams
from widellm.step_timer import StepTimer, maybe_phase
from widellm.structured_output.backend import StructuredOutputBackend
from widellm.structured_output.manager import StructuredOutputManager
from widellm.structured_output.registry import make_backend
from widellm.worker.cpu_allocator import use_one_arena
from widellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
# Builds a rank's model runner: (config, EP context or None, step timer or None) -> runner.
RunnerFactory = Callable[[EngineConfig, "ExpertParallelContext | None", "StepTimer | None"],
                         ModelRunner]
# How long an offline step with nothing to run but KV loads waits for one to end.
KV_TRANSFER_WAIT_S = 0.002


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    # vLLM's cache_salt: requests with different salts never share a prefix-cache block.
    cache_salt: str | None = None
    # The KV connector's parameters (disaggregated prefill/decode), as the client sent them.
    kv_transfer_params: dict | None = None


class EngineCore:
    """One rank's scheduler and model runner.

    Args:
        config: the engine configuration.
        dp_groups: this rank's process groups when it is one of several data-parallel ranks;
            with expert parallelism its MoE layers exchange tokens over them, and every step
            runs a forward (a dummy batch when nothing is scheduled) so that they line up.
        runner_factory: builds the model runner from (config, EP context, step timer); the
            real :class:`ModelRunner` by default, a simulated one in a simulator.
        clock: seconds on a monotonic clock, for step and forward durations (they feed the
            stats and DBO's auto policy) and requests' queued / first-scheduled stamps (the
            frontend's phase times); a simulator passes the virtual clock its runner advances.
    """

    def __init__(self, config: EngineConfig, dp_groups: DPGroups | None = None,
                 runner_factory: RunnerFactory = ModelRunner,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.runner_factory, self.clock = runner_factory, clock
        pc = config.parallel_config
        self.lockstep = pc.needs_lockstep
        if self.lockstep and dp_groups is None:
            raise ValueError("expert parallelism over several ranks needs their process groups")
        ep = None
        if self.lockstep:
            ep = ExpertParallelContext(
                rank=dp_groups.rank, size=dp_groups.size, group=dp_groups.device_group,
                all2all_backend=pc.all2all_backend, fixed_capacity=pc.all2all_fixed_capacity,
                max_tokens_per_rank=config.scheduler_config.max_num_batched_tokens,
                max_seqs_per_rank=config.scheduler_config.max_num_seqs,
                num_redundant_experts=config.eplb_config.num_redundant_experts,
                enable_eplb=config.eplb_config.enable_eplb,
                fixed_size_per_step=not config.scheduler_config.cudagraph_capture_sizes,
            )
        self.step_timer = (StepTimer(config.on_cuda, ExchangeLog() if trace_dir() else None)
                           if config.observability_config.collect_step_breakdown else None)
        self.async_scheduling = config.scheduler_config.async_scheduling
        # Async scheduling: steps submitted to the runner thread, oldest first. With
        # lockstep the loop keeps its own queue (of voted steps) on the same thread: that one
        # thread then issues every collective of this rank, in step order.
        self.batch_queue = BatchQueue(self)
        if not config.on_cuda:
            use_one_arena()  # before the runner thread allocates (see cpu_allocator)
        self.runner_thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="widellm-runner",
            initializer=init_compute_thread) if self.async_scheduling else None
        # The thread that runs the forwards also loads the model and warms it up: OpenMP
        # keeps a pool of worker threads per thread that ever ran a parallel region, and once
        # two pools exist their workers stop spinning between regions and sleep (measured:
        # decode steps 15-30% slower, ~3 context switches per op), so the loop thread must
        # never run one.
        self.model_runner, num_blocks = self._on_runner_thread(self._build_runner, ep)
        # Disaggregated prefill/decode: the connector's scheduler half names the worker
        # half's endpoint in the parameters it hands out.
        kvt = config.kv_transfer_config
        self.kv_worker = self.model_runner.kv_connector
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, num_blocks,
            make_scheduler(kvt, config.cache_config.block_size, self.kv_worker)
            if self.kv_worker is not None else None,
            kvt.kv_load_failure_policy if kvt is not None else "fail", clock)
        # Steps taken and the wall time of the latest, reported with the scheduler stats.
        self.num_steps = 0
        self.num_dbo_steps = 0
        self.last_step_duration_s = 0.0
        # Lockstep: whether steps split into micro-batches, and the previous forward's time
        # in microseconds, which the next vote reports (written and read by the one thread
        # that votes and runs forwards).
        self.dbo_policy = DboPolicy(pc)
        self._last_forward_us = 0
        # Lockstep: seconds this rank waited on its peers' votes inside waves of steps, plus
        # its dummy batches (widellm:lockstep_idle_seconds).
        self.lockstep_idle_s = 0.0
        # Structured outputs: requests wait here while their grammar compiles.
        self.structured = StructuredOutputManager(self._structured_output_backend)

    def _on_runner_thread(self, fn, *args):
        """``fn(*args)`` on the thread that runs the forwards (this one when synchronous)."""
        if self.runner_thread is None:
            return fn(*args)
        try:
            return self.runner_thread.submit(fn, *args).result()
        except BaseException:
            self.runner_thread.shutdown(wait=False)
            raise

    def _build_runner(self, ep: ExpertParallelContext | None) -> tuple[ModelRunner, int]:
        """The model runner with its KV cache allocated and its kernels warmed up."""
        runner = self.runner_factory(self.config, ep, self.step_timer)
        num_blocks = determine_num_blocks(self.config, runner.kv_spec.bytes_per_block)
        runner.initialize_kv_cache(num_blocks)
        sc = self.config.scheduler_config
        # The shapes of a full prefill step and of a full decode step.
        # (A decode step has at most max_num_seqs rows and never more than the token budget.)
        runner.warmup([sc.max_num_batched_tokens, min(sc.max_num_seqs, sc.max_num_batched_tokens)])
        return runner, num_blocks

    def warm_next_size(self) -> None:
        """Build one more prompt-step size's kernels (idle time), on the forward thread."""
        if self.model_runner.sizes_to_warm:
            self._on_runner_thread(self.model_runner.warm_next_size)

    def _structured_output_backend(self) -> StructuredOutputBackend:
        """The grammar engine over this model's tokenizer (built on first use)."""
        # Imported here: a core loads a tokenizer only for its first constrained request.
        from widellm.engine.tokenizer import get_tokenizer

        mc = self.config.model_config
        tokenizer = get_tokenizer(mc.tokenizer)
        eos = load_eos_token_ids(mc.model, mc.hf_config) or [tokenizer.eos_token_id]
        return make_backend(self.config.structured_outputs_config, tokenizer,
                            mc.hf_config.vocab_size, eos)

    def add_request(self, req: EngineCoreRequest) -> None:
        request = Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            frozenset(req.eos_token_ids), req.max_tokens, req.arrival_time, req.cache_salt,
            req.kv_transfer_params, queued_ts=self.clock(),
        )
        if request.sampling_params.structured_outputs is not None:
            self.structured.add(request)  # scheduled once its grammar is compiled
            return
        self.scheduler.add_request(request)
        self._start_kv_transfers()

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(self.structured.abort(request_ids))
        self._start_kv_transfers()

    def admit_compiled(self) -> list[EngineCoreOutput] | None:
        """Hand requests whose grammar is compiled to the scheduler; returns the outputs of
        those that failed to compile (None when none finished compiling)."""
        ready, failed = self.structured.pop_finished()
        for request in ready:
            self.scheduler.add_request(request)
        if ready:
            self._start_kv_transfers()
        if not (ready or failed):
            return None
        return [EngineCoreOutput(request_id=r.request_id, new_token_ids=[],
                                 finish_reason=r.status.finish_reason, stop_reason=r.stop_reason)
                for r in failed]

    # ---- KV transfer (disaggregated prefill/decode) -----------------------------------------

    def has_loads_in_flight(self) -> bool:
        """Requests not yet schedulable: waiting for their prompt KV or their grammar."""
        return bool(self.scheduler.waiting_for_remote) or self.structured.has_pending

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until a KV load or a grammar compilation may have ended."""
        if self.structured.has_pending:
            self.structured.wait(timeout_s)
        elif self.kv_worker is not None:
            self.kv_worker.wait_for_progress(timeout_s)

    def has_pending_kv_transfers(self) -> bool:
        return self.kv_worker is not None and self.scheduler.has_pending_kv_transfers()

    def poll_pending(self) -> list[EngineCoreOutput] | None:
        """Admit compiled structured requests, apply the transfers the connector finished
        (loaded requests rejoin the waiting queue, sent blocks are freed, failed loads follow
        the policy) and start the ones decided since; returns the outputs of failed
        requests, or None when nothing ended. Only on the thread that schedules."""
        compiled = self.admit_compiled()
        if self.kv_worker is None:
            return compiled
        finished = self.kv_worker.get_finished()
        outputs = compiled
        if not finished.is_empty:
            outputs = (outputs or []) + self.scheduler.update_from_kv_connector(finished)
        self._start_kv_transfers()
        return outputs

    def _start_kv_transfers(self) -> None:
        # Right after the scheduler decides: a hold must be registered before the output that
        # names it reaches the client, or a quick consumer's pull would find nothing held.
        if self.kv_worker is not None:
            meta = self.scheduler.kv_connector.build_connector_meta()
            if not meta.is_empty:
                self.kv_worker.start_load_kv(meta)

    def _update_from_output(self, so: SchedulerOutput,
                            runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(so, runner_output.resolve())
        self._start_kv_transfers()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> list[EngineCoreOutput]:
        kv_outputs = self.poll_pending() or []
        if not self.has_unfinished_requests():  # (steps in flight still get collected)
            if self.has_loads_in_flight():  # nothing to run until a load ends
                self.wait_for_loads(KV_TRANSFER_WAIT_S)
            return kv_outputs
        if self.async_scheduling:  # a step counts once its result is collected
            return kv_outputs + self.batch_queue.step()
        start = self.clock()
        try:
            return kv_outputs + self._step()
        finally:
            self.count_step(start)

    def make_stats(self) -> SchedulerStats:
        """The scheduler's numbers plus the step counters the frontend's stall check logs."""
        kv = None
        if self.kv_worker is not None:
            kv = self.kv_worker.stats()
            kv.num_recomputed = self.scheduler.num_recomputed
        return dataclasses.replace(self.scheduler.make_stats(), num_steps=self.num_steps,
                                   last_step_duration_s=self.last_step_duration_s,
                                   num_dbo_steps=self.num_dbo_steps, kv_transfer=kv,
                                   lockstep_idle_s=self.lockstep_idle_s)

    def _step(self) -> list[EngineCoreOutput]:
        if self.lockstep:
            raise RuntimeError("lockstep ranks step through plan_step and run_planned_step")
        with maybe_phase(self.step_timer, "schedule"):
            scheduler_output = self.scheduler.schedule()
        self._start_kv_transfers()
        runner_output = self.model_runner.execute_model(scheduler_output)
        with maybe_phase(self.step_timer, "schedule"):
            return self._update_from_output(scheduler_output, runner_output)

    # ---- lockstep (expert parallelism over several ranks) ----------------------------------

    def plan_step(self) -> PlannedStep:
        """Schedule and prepare this rank's next step, so that its row count can go into the
        ranks' vote before any forward runs."""
        return self.prepare_step(self.schedule_step())

    def schedule_step(self) -> SchedulerOutput | None:
        """This rank's scheduling decision for its next step (None: no request); lockstep and
        async ranks schedule through it."""
        if not self.scheduler.has_unfinished_requests():
            return None
        with maybe_phase(self.step_timer, "schedule"):
            so = self.scheduler.schedule()
        self._start_kv_transfers()
        return so

    def prepare_step(self, so: SchedulerOutput | None) -> PlannedStep:
        """Apply ``so`` to the runner's request states and build the forward's inputs. With
        async scheduling this runs on the runner thread, after the previous step sampled."""
        return PlannedStep(so, self.model_runner.prepare_model_input(so) if so else None)

    def vote_step(self, lockstep: DPLockstep, step: PlannedStep,
                  shutdown: bool) -> StepAgreement:
        """The ranks' vote on ``step`` (a collective), with the split decision every rank
        takes from it (see ``engine/dbo_policy.py``)."""
        start = self.clock()
        agreement = lockstep.sync(*self.make_vote(step, shutdown))
        if agreement.any_has_work:  # votes between waves are the whole deployment at rest
            self.lockstep_idle_s += self.clock() - start
        return self.adopt_agreement(agreement)

    def make_vote(self, step: PlannedStep, shutdown: bool) -> Vote:
        """This rank's vote on ``step`` (what :meth:`vote_step` sends; a simulator collects
        the votes of its ranks itself and combines them with ``lockstep.decide``)."""
        return Vote(step.has_work, shutdown, step.num_rows,
                    self.dbo_policy.vote(step.model_input), self._last_forward_us)

    def adopt_agreement(self, agreement: StepAgreement) -> StepAgreement:
        """The ranks' agreement with the split decision every rank takes from it (see
        ``engine/dbo_policy.py``); once per vote, on every rank."""
        self._last_forward_us = 0
        return agreement._replace(split=self.dbo_policy.decide(agreement))

    def forward_planned_step(self, step: PlannedStep,
                             agreement: StepAgreement) -> ModelRunnerOutput | None:
        """Run ``step``'s forward (a dummy batch when it holds none) as the ranks agreed."""
        start = self.clock()
        self.num_dbo_steps += agreement.split
        try:
            if step.model_input is None:
                self.model_runner.execute_dummy_batch(agreement.dp_metadata, agreement.split)
            if step.scheduler_output is None:
                return None
            return self.model_runner.run_model_input(step.model_input, agreement.dp_metadata,
                                                     agreement.split)
        finally:
            elapsed = self.clock() - start
            self._last_forward_us = int(elapsed * 1e6)
            if step.model_input is None:
                self.lockstep_idle_s += elapsed

    def finish_step(self, so: SchedulerOutput,
                    runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Hand a lockstep step's samples to the scheduler (on the thread that schedules)."""
        with maybe_phase(self.step_timer, "schedule"):
            return self._update_from_output(so, runner_output)

    def run_planned_step(self, step: PlannedStep,
                         agreement: StepAgreement) -> list[EngineCoreOutput]:
        """Run ``step`` (a dummy batch when it holds no forward) as the ranks agreed."""
        start = self.clock()
        runner_output = self.forward_planned_step(step, agreement)
        if runner_output is None:
            return []
        try:
            return self.finish_step(step.scheduler_output, runner_output)
        finally:
            self.count_step(start)

    def count_step(self, start: float, end: float | None = None) -> None:
        """One more step, run from ``start`` to ``end`` (default: now)."""
        self.num_steps += 1
        self.last_step_duration_s = (self.clock() if end is None else end) - start

    def shutdown(self) -> None:
        self.structured.shutdown()
        if self.runner_thread is not None:
            self.runner_thread.shutdown(wait=True, cancel_futures=True)
        self.model_runner.shutdown()
