"""Scheduler driven without a model: when a request stops (EOS, stop ids, max_tokens,
max_model_len, min_tokens and ignore_eos) and aborts of running, waiting and just-scheduled
requests."""

from tests.core.scheduler_cases import (
    EOS, STOP_TOKEN, TOKEN, all_blocks_free, fake_runner_output, make_request, make_scheduler,
    step,
)
from widellm.core.outputs import EngineCoreOutput
from widellm.core.request import Request, RequestStatus
from widellm.core.scheduler import Scheduler


# ---- stop conditions -------------------------------------------------------------------------


def run_one(sched: Scheduler, request: Request, samples: list[int]) -> list[EngineCoreOutput]:
    """Feeds ``samples`` one per step to a lone request; returns its outputs in order."""
    sched.add_request(request)
    outputs = []
    for token in samples:
        _, by_id = step(sched, {request.request_id: token})
        outputs.append(by_id[request.request_id])
    return outputs


def test_eos_stops_the_request_and_frees_its_blocks():
    sched = make_scheduler()
    outputs = run_one(sched, make_request("r", [5, 6, 7]), [TOKEN, EOS])

    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outputs] == [
        ([TOKEN], None, None), ([EOS], "stop", None),
    ]
    assert not sched.has_unfinished_requests()
    assert all_blocks_free(sched)
    assert sched.schedule().finished_req_ids == {"r"}


def test_eos_does_not_stop_before_min_tokens():
    sched = make_scheduler()
    outputs = run_one(sched, make_request("r", [5, 6, 7], min_tokens=2), [EOS, EOS])

    assert [o.finish_reason for o in outputs] == [None, "stop"]


def test_eos_does_not_stop_with_ignore_eos():
    sched = make_scheduler()
    outputs = run_one(
        sched, make_request("r", [5, 6, 7], max_tokens=3, ignore_eos=True), [EOS, EOS, EOS]
    )

    assert [o.finish_reason for o in outputs] == [None, None, "length"]


def test_stop_token_id_stops_with_the_id_as_stop_reason():
    sched = make_scheduler()
    outputs = run_one(
        sched, make_request("r", [5, 6, 7], stop_token_ids=[STOP_TOKEN]), [TOKEN, STOP_TOKEN]
    )

    assert [(o.finish_reason, o.stop_reason) for o in outputs] == [
        (None, None), ("stop", STOP_TOKEN),
    ]


def test_stop_token_id_does_not_stop_before_min_tokens():
    sched = make_scheduler()
    outputs = run_one(
        sched, make_request("r", [5, 6, 7], min_tokens=2, stop_token_ids=[STOP_TOKEN]),
        [STOP_TOKEN, STOP_TOKEN],
    )

    assert [(o.finish_reason, o.stop_reason) for o in outputs] == [
        (None, None), ("stop", STOP_TOKEN),
    ]


def test_max_tokens_caps_the_length():
    sched = make_scheduler()
    outputs = run_one(sched, make_request("r", [5, 6, 7], max_tokens=3), [TOKEN] * 3)

    assert [o.finish_reason for o in outputs] == [None, None, "length"]
    assert outputs[-1].stop_reason is None
    assert all_blocks_free(sched)


def test_a_stop_on_the_last_allowed_token_reports_stop_not_length():
    # The model chose to end there; "length" would tell the client the text was cut off.
    sched = make_scheduler()
    eos_outputs = run_one(sched, make_request("eos", [5, 6, 7], max_tokens=1), [EOS])
    stop_outputs = run_one(
        sched, make_request("stop", [5, 6, 7], max_tokens=1, stop_token_ids=[STOP_TOKEN]),
        [STOP_TOKEN],
    )

    assert (eos_outputs[0].finish_reason, eos_outputs[0].stop_reason) == ("stop", None)
    assert (stop_outputs[0].finish_reason, stop_outputs[0].stop_reason) == ("stop", STOP_TOKEN)


def test_max_model_len_caps_the_length():
    sched = make_scheduler(max_model_len=8)
    # 6 prompt tokens + 2 outputs reach the context length long before max_tokens=16.
    outputs = run_one(sched, make_request("r", [1] * 6), [TOKEN] * 2)

    assert [o.finish_reason for o in outputs] == [None, "length"]
    assert not sched.has_unfinished_requests()


# ---- abort -----------------------------------------------------------------------------------


def test_abort_running_request_frees_blocks_and_reports_it_next_step():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", [10] * 6))
    sched.add_request(make_request("b", [20] * 6))
    step(sched)
    a = sched.requests["a"]
    assert sched.kv_cache_manager.num_free_blocks == 4

    sched.abort_requests(["a"])

    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.status.finish_reason == "abort"
    assert sched.kv_cache_manager.num_free_blocks == 6
    assert [r.request_id for r in sched.running] == ["b"]
    out, _ = step(sched)
    assert out.finished_req_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 1}
    assert step(sched)[0].finished_req_ids == set()  # reported once


def test_abort_waiting_and_unknown_requests():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", [10] * 4))
    sched.add_request(make_request("b", [20] * 4))
    step(sched)

    sched.abort_requests(["b", "never-added"])

    assert list(sched.waiting) == []
    assert sched.get_num_unfinished_requests() == 1
    assert step(sched)[0].finished_req_ids == {"b"}


def test_abort_between_schedule_and_update_drops_the_sampled_token():
    sched = make_scheduler()
    sched.add_request(make_request("a", [10] * 4))
    sched.add_request(make_request("b", [20] * 4))
    out = sched.schedule()
    runner_output = fake_runner_output(sched, out)

    sched.abort_requests(["a"])
    outputs = sched.update_from_output(out, runner_output)

    assert [o.request_id for o in outputs] == ["b"]
    assert sched.schedule().finished_req_ids == {"a"}
    sched.abort_requests(["b"])
    assert all_blocks_free(sched)
