"""The engine core's half: compile each structured request's grammar off the step loop and
hold the request back until it is compiled.

A large JSON schema takes from milliseconds to seconds to compile against a vocabulary of
tens of thousands of tokens, so compiling inside a step would stall every running request.
Here one worker thread builds the backend (the tokenizer, on first use) and compiles; the
engine core polls ``pop_finished`` each loop iteration and gives compiled requests to the
scheduler, with the grammar attached (``Request.grammar``), or fails them with the error.
The backend caches compiled grammars, so a repeated schema costs microseconds.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from widellm.core.request import Request, RequestStatus
from widellm.sampling_params import StructuredOutputsParams
from widellm.structured_output.backend import CompiledGrammar, StructuredOutputBackend

logger = logging.getLogger(__name__)
# How many of the latest compile times a manager keeps.
RECENT_COMPILE_TIMES = 1024


class StructuredOutputManager:
    """Args:
        backend_factory: builds the backend (loads the tokenizer); called once, on the
            worker thread, when the first structured request arrives.
    """

    def __init__(self, backend_factory: Callable[[], StructuredOutputBackend]) -> None:
        self._backend_factory = backend_factory
        self._executor: ThreadPoolExecutor | None = None
        self._backend: Future[StructuredOutputBackend] | None = None
        # req_id -> (request, its compilation), in arrival order.
        self._pending: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}
        # Seconds the latest compilations took, for the caller to read (benchmarks, logs);
        # bounded, so a long-running server does not keep one entry per request.
        self.compile_times_s: deque[float] = deque(maxlen=RECENT_COMPILE_TIMES)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def add(self, request: Request) -> None:
        """Start compiling ``request``'s grammar; it stays here until ``pop_finished``."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="widellm-grammar")
            self._backend = self._executor.submit(self._backend_factory)
        params = request.sampling_params.structured_outputs
        self._pending[request.request_id] = (request, self._executor.submit(self._compile,
                                                                            params))

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        backend = self._backend.result()
        start = time.perf_counter()
        compiled = backend.compile(params)
        elapsed = time.perf_counter() - start
        self.compile_times_s.append(elapsed)
        logger.debug("compiled a %s grammar in %.2f ms", params.kind, elapsed * 1e3)
        return compiled

    def abort(self, request_ids: list[str]) -> list[str]:
        """Drop the ones still compiling; returns the others. A compilation that has not
        started is cancelled, so an aborted request costs the worker nothing."""
        rest = []
        for req_id in request_ids:
            entry = self._pending.pop(req_id, None)
            if entry is None:
                rest.append(req_id)
            else:
                request, future = entry
                future.cancel()  # False once it runs: the result is then discarded
                request.status = RequestStatus.FINISHED_ABORTED
        return rest

    def pop_finished(self) -> tuple[list[Request], list[Request]]:
        """(compiled, failed) requests, each in arrival order. A compiled one carries its
        grammar; a failed one is FINISHED_ERROR with the reason in ``stop_reason``."""
        ready: list[Request] = []
        failed: list[Request] = []
        for req_id, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[req_id]
            error = future.exception()
            if error is None:
                request.grammar = future.result()
                ready.append(request)
            else:
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = f"structured_outputs: {error}"
                failed.append(request)
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block until a compilation ends or ``timeout_s`` passes."""
        if self._pending:
            wait([f for _, f in self._pending.values()], timeout_s, FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
