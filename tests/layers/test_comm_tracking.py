"""Exposed vs hidden accounting of a tracked transfer, on a scripted clock: the time blocked in
``wait`` is exposed; the part of the transfer's life before the wait began is hidden (all of
it when the transfer completed before the wait, none when the wait came right after launch)."""

from __future__ import annotations

import torch

from widellm.layers.moe import comm_tracking
from widellm.layers.moe.comm_tracking import TrackedWork
from widellm.step_timer import StepTimer


class _ScriptedWork:
    """A work handle whose completion the test triggers (as gloo's thread would)."""

    def __init__(self, complete_in_wait: bool) -> None:
        self.future = torch.futures.Future()
        self.complete_in_wait = complete_in_wait

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self) -> None:
        if self.complete_in_wait:
            self.future.set_result(None)


def _clock(monkeypatch, times: list[float]) -> None:
    ticks = iter(times)
    monkeypatch.setattr(comm_tracking.time, "perf_counter", lambda: next(ticks))


def test_a_transfer_done_before_its_wait_is_all_hidden(monkeypatch):
    # launch at 1.0, completes at 3.0, wait from 5.0 to 5.5
    _clock(monkeypatch, [1.0, 3.0, 5.0, 5.5])
    timer, work = StepTimer(), _ScriptedWork(complete_in_wait=False)
    tracked = TrackedWork(work, timer)
    work.future.set_result(None)
    tracked.wait()
    assert timer.totals == {"comm_exposed": 0.5, "comm_window": 2.0}


def test_a_transfer_that_ends_inside_its_wait_is_hidden_up_to_the_wait(monkeypatch):
    # launch at 1.0, wait from 2.0; it completes at 4.0 and the wait returns at 4.5
    _clock(monkeypatch, [1.0, 2.0, 4.0, 4.5])
    timer, work = StepTimer(), _ScriptedWork(complete_in_wait=True)
    TrackedWork(work, timer).wait()
    assert timer.totals == {"comm_exposed": 2.5, "comm_window": 1.0}


def test_without_a_timer_nothing_is_recorded_or_hooked():
    work = _ScriptedWork(complete_in_wait=True)
    TrackedWork(work, None).wait()
    assert work.future.done()  # waited; no callback was needed to get here


class _WorkWithoutFuture(_ScriptedWork):
    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented.")


def test_a_handle_without_a_future_counts_as_in_flight_until_its_wait(monkeypatch):
    # launch at 1.0, wait from 4.0 to 4.25
    _clock(monkeypatch, [1.0, 4.0, 4.25])
    timer = StepTimer()
    TrackedWork(_WorkWithoutFuture(complete_in_wait=False), timer).wait()
    assert timer.totals == {"comm_exposed": 0.25, "comm_window": 3.0}
