"""The scheduler's request timestamps: a request's first admission is stamped on the engine
core's clock (a preemption's re-admission keeps it), and its first output carries when it was
queued and first scheduled; later outputs carry neither."""

from __future__ import annotations

from tests.core.scheduler_cases import BLOCK_SIZE, EOS, step
from widellm.config import CacheConfig, SchedulerConfig
from widellm.core.request import Request
from widellm.core.scheduler import Scheduler
from widellm.sampling_params import SamplingParams

QUEUED_TS = 90.0


def _request(req_id: str, prompt: list[int], max_tokens: int = 16) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), frozenset({EOS}),
                   max_tokens, queued_ts=QUEUED_TS)


def test_first_admission_stamped_once_and_sent_with_the_first_output():
    now = [100.0]
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16,
                                      max_model_len=256),
                      CacheConfig(block_size=BLOCK_SIZE), 4, clock=lambda: now[0])
    # The preemption scenario of test_scheduler: b is preempted in step 2, back in step 3.
    sched.add_request(_request("a", list(range(10, 18)), max_tokens=2))
    sched.add_request(_request("b", list(range(20, 25))))
    _, outputs = step(sched)
    assert {r: (o.queued_ts, o.scheduled_ts) for r, o in outputs.items()} == {
        "a": (QUEUED_TS, 100.0), "b": (QUEUED_TS, 100.0)}

    now[0] = 101.0
    sched.add_request(_request("c", [30, 31]))
    out, outputs = step(sched)
    assert out.preempted_req_ids == {"b"}
    assert (outputs["a"].queued_ts, outputs["a"].scheduled_ts) == (None, None)

    now[0] = 102.0
    b = sched.requests["b"]
    _, outputs = step(sched)
    assert b.scheduled_ts == 100.0  # re-admitted after the preemption: the first one stays
    assert (outputs["b"].queued_ts, outputs["b"].scheduled_ts) == (None, None)
    assert (outputs["c"].queued_ts, outputs["c"].scheduled_ts) == (QUEUED_TS, 102.0)
