"""StallDetector: a request without tokens for the timeout is logged once per stall, with its
core's state, and counted in widellm:request_stalls; tokens end the stall."""

from __future__ import annotations

import logging
import types

import pytest

from widellm.core.scheduler_stats import SchedulerStats
from widellm.engine import stall_detector
from widellm.engine.metrics import EngineMetrics
from widellm.engine.stall_detector import StallDetector

TIMEOUT_S = 10.0
NUM_ENGINES = 2
MAX_MODEL_LEN = 128


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(stall_detector, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def _stalls(metrics: EngineMetrics, engine: str) -> float:
    return metrics.registry.get_sample_value(
        "widellm:request_stalls_total", {"model_name": "m", "engine": engine}) or 0.0


def test_one_report_per_stall_with_the_core_state(clock, caplog):
    metrics = EngineMetrics("m", NUM_ENGINES, MAX_MODEL_LEN)
    ranks = {"a-0": 1, "a-1": 1}
    det = StallDetector(TIMEOUT_S, metrics, ranks.get)
    det.add("a", ["a-0", "a-1"])
    det.core_reported(1, SchedulerStats(3, 2, 0.5, 0, 0, 0, num_steps=41,
                                        last_step_duration_s=0.25))
    clock[0] += TIMEOUT_S - 0.1
    assert det.check() == []
    clock[0] += 0.2
    with caplog.at_level(logging.WARNING):
        assert det.check() == ["a"]
    assert ("request a has had no token for 10.1 s; engine core 1: 41 steps, 3 running, "
            "2 waiting, last step took 0.250 s, last report 10.1 s ago") in caplog.text
    assert det.check() == []  # reported once per stall
    assert _stalls(metrics, "1") == 1
    det.tokens_arrived("a-1")  # a sibling's token ends the stall
    clock[0] += TIMEOUT_S - 0.1
    assert det.check() == []
    clock[0] += 0.2
    assert det.check() == ["a"]
    assert _stalls(metrics, "1") == 2
    det.remove("a")
    clock[0] += 3 * TIMEOUT_S
    assert det.check() == []


def test_unrouted_request_and_disabled_check(clock):
    metrics = EngineMetrics("m", NUM_ENGINES, MAX_MODEL_LEN)
    det = StallDetector(TIMEOUT_S, metrics, lambda _: None)
    det.add("b", ["b"])
    clock[0] += TIMEOUT_S
    assert det.check() == ["b"]
    assert _stalls(metrics, "none") == 1
    off = StallDetector(0.0, metrics, lambda _: None)
    off.add("c", ["c"])
    clock[0] += 100 * TIMEOUT_S
    assert off.check() == []
