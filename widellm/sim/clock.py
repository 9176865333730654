"""Virtual time for the simulator: one clock shared by every engine core of a deployment.

The engine cores read it where the engine reads ``time.monotonic`` (request stamps, step and
forward durations; see ``EngineCore(clock=...)``). Only the cluster driver and the simulated
runner move it: the driver sets it to a step's start before each rank runs its part of the
step, and the runner's forward moves it to the step's end, so every rank measures the same
forward duration, the one the cost model priced.
"""

from __future__ import annotations


class VirtualClock:
    """Seconds of simulated time, callable like ``time.monotonic``.

    Args:
        start_s: the time at construction.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self.now = float(start_s)

    def __call__(self) -> float:
        return self.now

    def set(self, t: float) -> None:
        """Jump to ``t`` seconds (backwards only to replay one step's start for another rank
        of the same lockstep step)."""
        self.now = float(t)

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0); returns the new time."""
        if seconds < 0:
            raise ValueError(f"time cannot go backwards by {seconds} s")
        self.now += seconds
        return self.now
