"""Dual-batch overlap: run one step's micro-batches through the model, interleaved.

Each micro-batch runs ``model(input_ids, positions)`` (the one definition of the model) on its
own thread, inside its own forward context that carries the step's :class:`UBatchBaton`;
the MoE layers hand over at their launches (see :mod:`widellm.ubatching`), so micro-batch 1's
attention and experts run while micro-batch 0's tokens travel, and the other way round. Why
threads rather than generators: the hand-over points sit deep inside the layers (and inside a
backend's wait half), and a thread keeps every layer a plain function instead of making each
one, and each caller, a generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from widellm.compute_threads import init_compute_thread
from widellm.forward_context import set_forward_context
from widellm.step_timer import StepTimer, never_away
from widellm.ubatching import UBatchBaton
from widellm.worker.ubatch_split import MicroBatch

NUM_UBATCHES = 2


class DualBatchRunner:
    """Runs split steps; owns the micro-batch threads (created once, reused every step)."""

    def __init__(self, model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.model = model
        self._threads = ThreadPoolExecutor(max_workers=NUM_UBATCHES,
                                           thread_name_prefix="widellm-ubatch",
                                           initializer=init_compute_thread)

    def run(self, ubatches: Sequence[MicroBatch], timer: StepTimer | None) -> torch.Tensor:
        """``[sum of rows, H]``: the micro-batches' hidden states, concatenated in row order."""
        if len(ubatches) != NUM_UBATCHES:
            raise ValueError(f"dual-batch overlap runs {NUM_UBATCHES} micro-batches, "
                             f"got {len(ubatches)}")
        baton = UBatchBaton(NUM_UBATCHES)
        if timer is not None:
            timer.away_clock = baton.away_s
        try:
            futures = [self._threads.submit(self._run_one, baton, i, ub, timer)
                       for i, ub in enumerate(ubatches)]
            # Both end before this returns or raises: a failed micro-batch passes the baton on
            # (finish), so the other is never left waiting for it.
            wait(futures)
            return torch.cat([f.result() for f in futures])
        finally:
            if timer is not None:
                timer.away_clock = never_away

    def _run_one(self, baton: UBatchBaton, index: int, ub: MicroBatch,
                 timer: StepTimer | None) -> torch.Tensor:
        # inference_mode is per thread; the caller's does not reach this one.
        with torch.inference_mode():
            baton.enter(index)
            try:
                with set_forward_context(ub.attn_metadata, timer, ub.dp_metadata, baton):
                    return self.model(ub.input_ids, ub.positions)
            finally:
                baton.finish()

    def shutdown(self) -> None:
        self._threads.shutdown(wait=True)
