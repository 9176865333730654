"""AsyncLLM: the server's engine. Tokenizes and validates in the frontend, sends requests to
the engine-core process, turns its token batches into streamed ``RequestOutput`` deltas.

One background task reads the core's output socket and feeds per-request queues; ``generate``
is an async iterator over one request's queue. A consumer that stops iterating (a client that
disconnected) aborts its request, so its KV blocks are freed within a step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

from widellm.engine.arg_utils import EngineArgs
from widellm.engine.core_client import (
    DEATH_NOTICE_S, DEATH_POLL_S, EngineCoreClient, EngineDeadError,
)
from widellm.engine.iteration_stats import IterationStats
from widellm.engine.metrics import EngineMetrics
from widellm.engine.output_processor import OutputProcessor, RequestOutputKind
from widellm.engine.processor import InputProcessor, PromptType
from widellm.engine.request_logger import RequestLogger
from widellm.engine.stall_detector import StallDetector
from widellm.outputs import RequestOutput
from widellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How often the output loop wakes without output to check that the core is still alive.
HEALTH_POLL_S = 0.5


class EngineDrainingError(RuntimeError):
    """The server is shutting down: it takes no new requests, and cuts the ones still running
    when its drain timeout ends."""


class RequestFailedError(RuntimeError):
    """The engine ended the request with an error of its own (finish reason ``error``: a
    failed KV load from a prefill instance under ``kv_load_failure_policy: fail``)."""


class AsyncLLM:
    def __init__(self, engine_args: EngineArgs, log_stats: bool = True,
                 request_logger: RequestLogger | None = None) -> None:
        # log_stats off (--disable-log-stats) drops only the periodic throughput log line;
        # the metrics behind /metrics are still recorded.
        self.log_stats = log_stats
        self.request_logger = request_logger
        self.config = engine_args.create_engine_config()
        self.model_config = self.config.model_config
        self.processor = InputProcessor.from_model_config(
            self.model_config, self.config.kv_transfer_config,
            self.config.structured_outputs_config.backend)
        self.tokenizer = self.processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics.for_config(self.config)
        self.client = EngineCoreClient(self.config)
        self.metrics.record_kv_blocks(self.client.kv_blocks_by_rank)
        self.stall_detector = StallDetector(
            self.config.observability_config.request_stall_timeout_s, self.metrics,
            self.client.rank_of)
        self.dead_error: str | None = None
        # Set by the server's shutdown: ``draining`` refuses new requests at the door,
        # ``_cut_reason`` then ends the running ones.
        self.draining = False
        self._cut_reason: str | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._output_task: asyncio.Task | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs) -> "AsyncLLM":
        return cls(engine_args, **kwargs)

    @property
    def errored(self) -> bool:
        return self.dead_error is not None or not self.client.is_alive()

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(self.dead_error or self.client.dead_reason())

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
        data_parallel_rank: int | None = None, cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield DELTA outputs until the request finishes. Raises ValueError for bad input
        (before anything is queued) and EngineDeadError if a core dies meanwhile. The request
        goes to ``data_parallel_rank`` if given, else to the rank the balancer picks.
        ``cache_salt`` (or the prompt dict's) keeps its prefix-cache blocks to its salt."""
        await self.check_health()
        if self._cut_reason is not None:  # arrived after the drain timeout's cut
            raise EngineDrainingError(self._cut_reason)
        self._ensure_output_task()
        text, token_ids = self.processor.tokenize(prompt)
        if self.request_logger is not None:
            self.request_logger.log_request(request_id, text, token_ids, sampling_params)
        self.processor.validate_prompt(token_ids)
        cache_salt = self.processor.cache_salt(prompt, cache_salt)
        self.client.check_rank(data_parallel_rank)
        queue: asyncio.Queue = asyncio.Queue()
        core_ids = self.output_processor.add_request(
            request_id, text, token_ids, sampling_params, RequestOutputKind.DELTA
        )
        self._queues[request_id] = queue
        self.stall_detector.add(request_id, core_ids)
        finished = False
        try:
            await self.client.add_requests_async(
                self.processor.make_core_requests(request_id, token_ids, sampling_params,
                                                  core_ids, cache_salt),
                data_parallel_rank,
            )
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                failed = [o for o in item.outputs if o.finish_reason == "error"]
                if failed:
                    raise RequestFailedError(str(failed[0].stop_reason))
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self.stall_detector.remove(request_id)
            if not finished:  # consumer went away or the engine died: free its blocks
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        core_ids = self.output_processor.abort_requests([request_id])
        self._queues.pop(request_id, None)
        if core_ids and not self.errored:
            # Each sequence still running counts, on the rank that held it.
            self.metrics.record_aborted(self.client.rank_of(core_ids[0]), len(core_ids))
            await self.client.abort_requests_async(core_ids)

    @property
    def num_in_flight(self) -> int:
        """Requests between ``generate``'s start and their last output."""
        return len(self._queues)

    def start_draining(self) -> None:
        """From now on the serving layer refuses new requests; running ones go on."""
        self.draining = True

    def cut_in_flight(self, reason: str) -> int:
        """End every running request with ``EngineDrainingError(reason)``: each ``generate``
        raises it and aborts its engine requests, and so does any ``generate`` that starts
        later. Returns how many were cut."""
        self._cut_reason = reason
        for q in self._queues.values():
            q.put_nowait(EngineDrainingError(reason))
        return len(self._queues)

    def _ensure_output_task(self) -> None:
        if self._output_task is None or self._output_task.done():
            self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    async def _output_loop(self) -> None:
        try:
            while True:
                batch = await self.client.get_output_async(HEALTH_POLL_S)
                # Every wake-up, output or not: a core stuck in a step sends nothing.
                self.stall_detector.check()
                # Polled on every wake-up, too: that reaps a core that died while others
                # keep sending output.
                if not self.client.is_alive():
                    raise EngineDeadError(self.client.dead_reason())
                if batch is None:
                    continue
                if batch.engine_error is not None:
                    raise EngineDeadError(await self._failure_reason(batch.dp_rank,
                                                                     batch.engine_error))
                self.stall_detector.core_reported(batch.dp_rank, batch.scheduler_stats)
                for core_out in batch.outputs:
                    if core_out.new_token_ids:
                        self.stall_detector.tokens_arrived(core_out.request_id)
                if batch.scheduler_stats is not None:
                    self.metrics.record_scheduler_stats(batch.scheduler_stats, batch.dp_rank)
                if batch.eplb_stats is not None:
                    self.metrics.record_eplb(batch.eplb_stats, batch.dp_rank)
                if batch.step_breakdown is not None:
                    self.metrics.record_step_breakdown(batch.step_breakdown, batch.dp_rank)
                iteration = IterationStats(batch.dp_rank, batch.timestamp)
                outputs, to_abort = self.output_processor.process_outputs(batch.outputs,
                                                                          iteration)
                self.metrics.record_iteration(iteration)
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
                if to_abort:
                    await self.client.abort_requests_async(to_abort)
                if self.log_stats:
                    self.metrics.maybe_log()
        except EngineDeadError as e:
            self.dead_error = str(e)
            logger.error("%s; failing %d in-flight requests", e, len(self._queues))
            for q in self._queues.values():
                q.put_nowait(EngineDeadError(str(e)))
            await self._reap_cores()

    async def _reap_cores(self) -> None:
        """The other ranks exit after a failure of their own; poll (and so reap) them until
        they have, so none stays a zombie of a server that lives on to answer 503s."""
        while any(p.is_alive() for p in self.client.procs):
            await asyncio.sleep(HEALTH_POLL_S)

    async def _failure_reason(self, rank: int, engine_error: str) -> str:
        # A moment for another rank's death to show (EngineCoreClient.failure_reason).
        deadline = time.monotonic() + DEATH_NOTICE_S
        while self.client.others_alive(rank) and time.monotonic() < deadline:
            await asyncio.sleep(DEATH_POLL_S)
        return self.client.failure_reason(rank, engine_error)

    def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        self.client.shutdown()
