"""The async lockstep pipeline's room for another step: two steps in flight behind a
decode-only step, one behind a step with prompt tokens (a step scheduled behind it would miss
the requests that arrive while it runs), and ``has_prompt_tokens`` telling the two apart."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from widellm.core.scheduler_output import CachedRequestData, SchedulerOutput
from widellm.engine.lockstep_pipeline import LockstepPipeline


def _output(tokens: dict[str, int], new: int = 0) -> SchedulerOutput:
    """A step computing ``tokens[req]`` tokens per request, the first ``new`` of them new."""
    return SchedulerOutput([SimpleNamespace(req_id=r) for r in list(tokens)[:new]],
                           CachedRequestData(), dict(tokens), sum(tokens.values()), set(), set())


def test_has_prompt_tokens():
    assert _output({"a": 5}, new=1).has_prompt_tokens  # a new request
    assert _output({"a": 1}, new=1).has_prompt_tokens  # even with a one-token prompt
    assert _output({"a": 1, "b": 64}).has_prompt_tokens  # a later chunk of b's prompt
    assert not _output({"a": 1, "b": 1}).has_prompt_tokens  # decodes only
    assert not _output({}).has_prompt_tokens


def test_room_behind_decode_and_prompt_steps():
    release = threading.Event()
    with ThreadPoolExecutor(1) as runner:
        pipe = LockstepPipeline(SimpleNamespace(runner_thread=runner), lockstep=None)
        pipe._run = lambda so, shutdown: release.wait(30)  # a job that runs until released
        pipe.submit(_output({"a": 1, "b": 1}), False)
        assert not pipe.full  # behind a decode-only step: schedule the next one now
        pipe.submit(_output({"a": 1, "c": 32}, new=1), False)
        assert pipe.full  # two in flight
        release.set()
        pipe.collect()
        assert pipe.full  # one in flight, and it carries prompt tokens
        pipe.collect()
        assert not pipe.full and not pipe.in_flight
        pipe.submit(None, False)  # a vote without work
        assert not pipe.full
        pipe.collect()
