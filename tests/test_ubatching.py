"""The dual-batch baton: exactly one micro-batch runs at a time, turns alternate at each
yield, a finished micro-batch leaves the other running alone, and a phase timed on a
micro-batch thread leaves out the time it waited for the baton."""

from __future__ import annotations

import threading
import time

from widellm.step_timer import StepTimer
from widellm.ubatching import UBatchBaton

JOIN_TIMEOUT_S = 10
HOLD_S = 0.05


def _run(baton: UBatchBaton, bodies) -> list[BaseException]:
    """Run each body on its own micro-batch thread (as DualBatchRunner does); their errors."""
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_body, args=(baton, i, body, errors))
               for i, body in enumerate(bodies)]
    for t in reversed(threads):  # start order must not matter
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
        assert not t.is_alive(), "baton deadlock"
    return errors


def _body(baton: UBatchBaton, index: int, body, errors: list[BaseException]) -> None:
    baton.enter(index)
    try:
        body(baton)
    except RuntimeError as e:
        errors.append(e)
    finally:
        baton.finish()


def test_turns_alternate_and_a_finished_micro_batch_drops_out():
    log: list[str] = []

    def first(baton):
        for step in "abcd":
            log.append("0" + step)
            baton.yield_turn()

    def second(baton):
        for step in "ab":
            log.append("1" + step)
            baton.yield_turn()

    _run(UBatchBaton(), [first, second])
    assert log == ["0a", "1a", "0b", "1b", "0c", "0d"]


def test_an_error_passes_the_baton_on():
    log: list[str] = []

    def failing(baton):
        log.append("0a")
        raise RuntimeError("boom")

    def other(baton):
        log.append("1a")
        baton.yield_turn()
        log.append("1b")

    errors = _run(UBatchBaton(), [failing, other])
    assert log == ["0a", "1a", "1b"] and [str(e) for e in errors] == ["boom"]


def test_phases_leave_out_the_wait_for_the_baton():
    timer = StepTimer()
    baton = UBatchBaton()
    timer.away_clock = baton.away_s

    def first(b):
        with timer.phase("first"):
            b.yield_turn()  # the second holds the baton for HOLD_S

    def second(b):
        time.sleep(HOLD_S)

    _run(baton, [first, second])
    assert timer.totals["first"] < HOLD_S / 2
