"""The baton of dual-batch overlap: micro-batch threads of which exactly one runs at a time.

Each micro-batch of a step runs the whole model (the one definition of every layer) on its own
thread, in its own forward context. The layers call :func:`widellm.forward_context.dbo_yield`
right after they launch a transfer (an MoE dispatch or combine); under DBO that hands the baton
to the other micro-batch, which computes while the transfer is in flight, until it launches
its own transfer and hands the baton back. Outside DBO the call does nothing.

Only one thread runs at a time and the hand-over points are fixed by the model's code, so the
order in which a rank issues its collectives is a function of the step alone: the same on every
rank that splits the same way (the lockstep vote makes them all split, or none). The first
micro-batch always runs first and is never behind the second at a hand-over, so every layer
writes the first micro-batch's KV before the second attends to it (a prompt chunk cut in two
attends across the cut).

On a GPU the same hand-over points become stream switches: the launches go on a comm stream
and each micro-batch waits on its transfer's event instead of blocking the host.
"""

from __future__ import annotations

import threading
import time


class UBatchBaton:
    """Hand-over between ``num_ubatches`` micro-batch threads.

    Lifecycle per thread: :meth:`enter` (wait for the first turn), any number of
    :meth:`yield_turn`, then :meth:`finish` (also on error, so the others never wait on it).
    Turns pass round-robin over the micro-batches that have not finished.
    """

    def __init__(self, num_ubatches: int = 2) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False] * num_ubatches
        # Per thread: its micro-batch index and the seconds it spent waiting for the baton.
        self._local = threading.local()

    def enter(self, index: int) -> None:
        """Called first on micro-batch ``index``'s thread: waits until it is its turn."""
        self._local.index, self._local.away_s = index, 0.0
        self._wait_for_turn(index)

    def yield_turn(self) -> None:
        """Let the next unfinished micro-batch run; return when the baton comes back."""
        index = self._local.index
        with self._cond:
            nxt = self._next_live(index)
            if nxt == index:
                return  # the others are done: nothing to overlap with
            self._turn = nxt
            self._cond.notify_all()
        self._wait_for_turn(index)

    def finish(self) -> None:
        """Mark this thread's micro-batch done and pass the baton on."""
        index = self._local.index
        with self._cond:
            self._done[index] = True
            if not all(self._done):
                self._turn = self._next_live(index)
            self._cond.notify_all()

    def away_s(self) -> float:
        """Seconds the calling thread has waited for the baton (0 outside a micro-batch): what
        a phase timer subtracts so a phase counts only its own micro-batch's time."""
        return getattr(self._local, "away_s", 0.0)

    def _wait_for_turn(self, index: int) -> None:
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._turn == index)
        self._local.away_s += time.perf_counter() - start

    def _next_live(self, index: int) -> int:
        n = len(self._done)
        for step in range(1, n + 1):
            candidate = (index + step) % n
            if not self._done[candidate]:
                return candidate
        return index
