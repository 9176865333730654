"""Scheduler driven without a model (hand-made runner outputs stand in for the sampler):
the token budget and order, preemption, prefix sharing and whole runs. Stop conditions and
aborts are in ``test_scheduler_stops.py``."""

import pytest

from tests.core.scheduler_cases import (
    EOS, MAX_STEPS, TOKEN, all_blocks_free, make_request, make_scheduler, step,
)
from widellm.core.request import RequestStatus
from widellm.core.scheduler_output import NewRequestData


# ---- budget and order ------------------------------------------------------------------------


def test_token_budget_chunks_the_prompt_that_does_not_fit():
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("a", [10] * 6))
    sched.add_request(make_request("b", [20] * 6))

    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 6, "b": 4}
    assert out.total_num_scheduled_tokens == 10
    assert [(n.req_id, n.block_ids) for n in out.scheduled_new_reqs] == [
        ("a", [0, 1]), ("b", [2]),
    ]
    assert list(outputs) == ["a"]  # b is mid-prefill: nothing sampled

    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}
    assert list(outputs) == ["a", "b"]


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("a", [10] * 4, max_tokens=2))
    sched.add_request(make_request("b", [20] * 4))
    sched.add_request(make_request("c", [30] * 4))

    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}  # budget left, but 2 seqs max

    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert outputs["a"].finish_reason == "length"

    out, _ = step(sched)
    assert out.finished_req_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 1, "c": 4}


def test_long_prompt_is_prefilled_in_chunks():
    sched = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(100, 125))  # 25 tokens -> 7 blocks
    sched.add_request(make_request("r", prompt))

    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"r": 8}
    assert out.scheduled_new_reqs == [NewRequestData(
        req_id="r", prompt_token_ids=prompt, output_token_ids=[],
        sampling_params=sched.requests["r"].sampling_params, eos_token_ids=frozenset({EOS}),
        block_ids=[0, 1], num_computed_tokens=0,
    )]
    assert outputs == {}

    # Afterwards only what changed: the computed count before the step and the new blocks.
    expected = [
        # (num_computed_tokens, new_block_ids, num_scheduled_tokens)
        (8, [2, 3], 8),
        (16, [4, 5], 8),
        (24, [6], 1),  # the last prompt token; the step samples the first output token
        (25, [], 1),  # decode: 26 tokens still fit in 7 blocks (28 slots)
        (26, [], 1),
        (27, [], 1),
        (28, [7], 1),  # token 28 opens block 8
    ]
    for num_computed, new_block_ids, num_scheduled in expected:
        out, outputs = step(sched)
        assert out.scheduled_new_reqs == []
        assert out.scheduled_cached_reqs.req_ids == ["r"]
        assert out.scheduled_cached_reqs.num_computed_tokens == [num_computed]
        assert out.scheduled_cached_reqs.new_block_ids == [new_block_ids]
        assert out.num_scheduled_tokens == {"r": num_scheduled}
        if num_computed + num_scheduled < len(prompt):
            assert outputs == {}  # mid-prefill: nothing sampled
        else:
            assert outputs["r"].new_token_ids == [TOKEN]
    assert sched.kv_cache_manager.get_block_ids("r") == list(range(8))


def test_running_requests_are_scheduled_before_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", [10] * 20))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 8}

    sched.add_request(make_request("b", [20] * 4))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 8}  # a's remaining chunk takes the whole budget
    assert [r.request_id for r in sched.waiting] == ["b"]

    out, _ = step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("a", 4), ("b", 4)]

    out, _ = step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1)]


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    sched.add_request(make_request("r", [1, 2, 3]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("r", [4, 5]))


# ---- preemption ------------------------------------------------------------------------------


def test_preemption_evicts_the_latest_admitted_and_resumes_it_first():
    sched = make_scheduler(num_blocks=4)
    a_prompt = list(range(10, 18))  # 8 tokens: blocks 0, 1 full
    b_prompt = list(range(20, 25))  # 5 tokens: blocks 2 (full, cached), 3 (1 token)
    sched.add_request(make_request("a", a_prompt, max_tokens=2))
    sched.add_request(make_request("b", b_prompt))
    out, _ = step(sched, {"b": 50})
    assert [(n.req_id, n.block_ids) for n in out.scheduled_new_reqs] == [
        ("a", [0, 1]), ("b", [2, 3]),
    ]
    assert sched.kv_cache_manager.num_free_blocks == 0

    sched.add_request(make_request("c", [30, 31]))
    # a's 9th token needs a third block; none is free, so b (admitted last) gives up its two.
    out, outputs = step(sched)
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs.new_block_ids == [[3]]  # b's tail block, freed first
    # No admission in a preempting step, although block 2 is free and the budget is unused.
    assert out.scheduled_new_reqs == []
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    b = sched.requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (
        RequestStatus.PREEMPTED, 0, 1
    )
    assert sched.make_stats().num_preemptions == 1
    assert outputs["a"].finish_reason == "length"  # frees blocks 0, 1, 3

    # b resumes in full, with its output token, and reuses its cached first block (block 2).
    out, outputs = step(sched)
    assert out.finished_req_ids == {"a"}
    assert out.preempted_req_ids == set()
    assert out.scheduled_new_reqs == [
        NewRequestData(
            req_id="b", prompt_token_ids=b_prompt, output_token_ids=[50],
            sampling_params=b.sampling_params, eos_token_ids=frozenset({EOS}),
            block_ids=[2, 3], num_computed_tokens=4,
        ),
        NewRequestData(
            req_id="c", prompt_token_ids=[30, 31], output_token_ids=[],
            sampling_params=sched.requests["c"].sampling_params, eos_token_ids=frozenset({EOS}),
            block_ids=[1], num_computed_tokens=0,
        ),
    ]
    # b recomputes prompt token 4 and its output token, then samples its second token.
    assert out.num_scheduled_tokens == {"b": 2, "c": 2}
    assert outputs["b"].new_token_ids == [TOKEN]
    assert b.output_token_ids == [50, TOKEN]


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_latest():
    sched = make_scheduler(num_blocks=4)
    sched.add_request(make_request("a", [10] * 5))  # 2 blocks with 3 free slots
    sched.add_request(make_request("b", [20] * 8))  # 2 full blocks
    step(sched)

    out, outputs = step(sched)

    # a's token fits in its own blocks; b's needs a fifth block, and b is the latest admitted.
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == {"b"}
    assert list(outputs) == ["a"]
    assert [r.request_id for r in sched.running] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert sched.kv_cache_manager.get_block_ids("b") == []
    assert sched.kv_cache_manager.num_free_blocks == 2


# ---- prefix sharing --------------------------------------------------------------------------


def test_same_prompt_in_one_step_shares_full_prefix_blocks():
    # a's blocks are registered in the prefix cache as soon as they are allocated, so b,
    # admitted right after in the same step, hits them before a's KV exists. That is safe:
    # within each layer the forward pass stores the KV of every scheduled token before any
    # attention reads the cache, so b's attention finds a's prefix KV already written.
    sched = make_scheduler()
    prompt = list(range(40, 50))  # 10 tokens: 2 full blocks + 2 tokens
    sched.add_request(make_request("a", prompt))
    sched.add_request(make_request("b", prompt))

    out, outputs = step(sched)

    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [
        ("a", [0, 1, 2], 0), ("b", [0, 1, 3], 8),
    ]
    assert out.num_scheduled_tokens == {"a": 10, "b": 2}
    assert [sched.kv_cache_manager.block_pool.blocks[i].ref_cnt for i in range(4)] == [
        2, 2, 1, 1,
    ]
    assert (outputs["a"].num_cached_tokens, outputs["b"].num_cached_tokens) == (0, 8)
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_a_partly_filled_block_is_never_shared():
    sched = make_scheduler()
    a_prompt = list(range(40, 50))  # 10 tokens: blocks 0, 1 full; block 2 holds 2 tokens
    sched.add_request(make_request("a", a_prompt))
    sched.add_request(make_request("b", a_prompt + [60] * 6))  # 16 tokens, same first 10

    out, _ = step(sched)

    # b's third block (tokens 48, 49, 60, 60) matches no registered block, so b shares only
    # blocks 0 and 1 and writes its own copy of tokens 48 and 49.
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [
        ("a", [0, 1, 2], 0), ("b", [0, 1, 3, 4], 8),
    ]
    assert out.num_scheduled_tokens == {"a": 10, "b": 8}


# ---- whole runs ------------------------------------------------------------------------------


def test_every_block_is_free_after_a_run_with_preemptions():
    # 6 blocks of 4 tokens for requests that need up to 5 blocks each: they must take turns.
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=8)
    wanted = {"a": 6, "b": 3, "c": 8, "d": 5}
    prompts = {"a": [1] * 9, "b": [1] * 9 + [2], "c": [3] * 5, "d": [4] * 13}
    for req_id, prompt in prompts.items():
        sched.add_request(make_request(req_id, prompt, max_tokens=wanted[req_id]))

    generated = {req_id: [] for req_id in wanted}
    finish = {}
    for _ in range(MAX_STEPS):
        if not sched.has_unfinished_requests():
            break
        _, outputs = step(sched)
        for req_id, o in outputs.items():
            generated[req_id] += o.new_token_ids
            if o.finished:
                finish[req_id] = o.finish_reason
    assert not sched.has_unfinished_requests()

    assert sched.num_preemptions > 0  # the pool really was too small for all at once
    assert {r: len(t) for r, t in generated.items()} == wanted
    assert finish == dict.fromkeys(wanted, "length")
    assert all_blocks_free(sched)
    assert sched.kv_cache_manager.req_to_blocks == {}
