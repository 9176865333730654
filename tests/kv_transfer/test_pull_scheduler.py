"""The pull connectors' scheduler half, on hand-made requests."""

import hashlib

import numpy as np
import pytest

from widellm.core.request import Request, RequestStatus
from widellm.kv_transfer.base import KVConnectorMetadata, LoadSpec
from widellm.kv_transfer.config import KVTransferConfig
from widellm.kv_transfer.pull_scheduler import PullConnectorScheduler, prompt_sha256
from widellm.sampling_params import SamplingParams

BLOCK_SIZE = 16
ENDPOINT = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "lease_s": 30.0}


def make_connector(role: str) -> PullConnectorScheduler:
    return PullConnectorScheduler(KVTransferConfig("TCPConnector", kv_role=role), BLOCK_SIZE,
                                  lambda: dict(ENDPOINT))


def make_request(req_id: str, prompt: list[int], params: dict | None = None) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=4), frozenset({2}), 4,
                   kv_transfer_params=params)


def remote_params(prompt: list[int], remote_block_ids: list[int], **over) -> dict:
    params = {"do_remote_prefill": True, "do_remote_decode": False, **ENDPOINT,
              "remote_request_id": "p-1", "remote_block_ids": remote_block_ids,
              "block_size": BLOCK_SIZE, "num_prompt_tokens": len(prompt),
              "prompt_sha256": prompt_sha256(prompt)}
    params.update(over)
    return params


PROMPT = list(range(100, 140))  # 40 tokens: blocks of 16, 16, 8


def test_prompt_sha256_is_over_int64_token_ids():
    assert prompt_sha256([1, 2]) == hashlib.sha256(
        np.array([1, 2], dtype=np.int64).tobytes()).hexdigest()
    assert prompt_sha256([1, 2]) != prompt_sha256([2, 1])


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_consumer_offers_all_but_the_last_prompt_token(role):
    conn = make_connector(role)
    req = make_request("x", PROMPT, remote_params(PROMPT, [100, 101, 102]))
    assert conn.get_num_new_matched_tokens(req, 0) == (39, True)
    assert conn.get_num_new_matched_tokens(req, 16) == (23, True)  # after a local hit
    assert conn.build_connector_meta().is_empty


def test_producer_role_and_plain_requests_offer_nothing():
    req = make_request("x", PROMPT, remote_params(PROMPT, [100, 101, 102]))
    assert make_connector("kv_producer").get_num_new_matched_tokens(req, 0) == (0, False)
    conn = make_connector("kv_consumer")
    assert conn.get_num_new_matched_tokens(make_request("y", PROMPT), 0) == (0, False)
    decode = make_request("z", PROMPT, {"do_remote_decode": True})
    assert conn.get_num_new_matched_tokens(decode, 0) == (0, False)
    assert conn.build_connector_meta().is_empty


def test_a_full_local_hit_releases_the_producer():
    conn = make_connector("kv_consumer")
    prompt = PROMPT[:17]
    params = remote_params(prompt, [100, 101])
    req = make_request("x", prompt, params)
    conn.track_remote_request(req)
    assert conn.get_num_new_matched_tokens(req, 16) == (0, False)
    assert req.kv_transfer_params is None
    meta = conn.build_connector_meta()
    assert meta.reqs_to_release == {"x": params}
    assert meta.reqs_to_track == {}  # no heartbeats for what is released
    assert meta.reqs_to_load == {} and meta.reqs_to_hold == {}
    # Params gone: asked again, nothing to load and nothing more to release.
    assert conn.get_num_new_matched_tokens(req, 16) == (0, False)
    assert conn.build_connector_meta().is_empty


def test_track_remote_request():
    conn = make_connector("kv_consumer")
    params = remote_params(PROMPT, [100, 101, 102])
    conn.track_remote_request(make_request("x", PROMPT, params))
    conn.track_remote_request(make_request("y", PROMPT))
    make_connector("kv_producer").track_remote_request(make_request("z", PROMPT, params))
    meta = conn.build_connector_meta()
    assert meta.reqs_to_track == {"x": params}
    assert meta.reqs_to_track["x"] is not params  # a copy
    assert conn.build_connector_meta().is_empty  # reset


def test_update_state_after_alloc_with_a_local_hit():
    conn = make_connector("kv_consumer")
    params = remote_params(PROMPT, [100, 101, 102])
    req = make_request("x", PROMPT, params)
    conn.update_state_after_alloc(req, [7, 8, 9], 23)
    meta = conn.build_connector_meta()
    assert meta.reqs_to_load == {"x": LoadSpec(params, [8, 9], [101, 102], 1, 39)}
    assert "error" not in meta.reqs_to_load["x"].params
    assert conn.build_connector_meta().reqs_to_load == {}


def test_update_state_after_alloc_without_a_hit():
    conn = make_connector("kv_consumer")
    params = remote_params(PROMPT, [100, 101, 102])
    conn.update_state_after_alloc(make_request("x", PROMPT, params), [7, 8, 9], 39)
    spec = conn.build_connector_meta().reqs_to_load["x"]
    assert (spec.local_block_ids, spec.remote_block_ids, spec.first_block) == (
        [7, 8, 9], [100, 101, 102], 0)


def test_a_prompt_of_one_block_and_one_token_loads_one_block():
    # 17 tokens: the first 16 load (one block); the 17th is computed locally.
    conn = make_connector("kv_consumer")
    prompt = PROMPT[:17]
    conn.update_state_after_alloc(make_request("x", prompt, remote_params(prompt, [50, 51])),
                                  [4], 16)
    spec = conn.build_connector_meta().reqs_to_load["x"]
    assert (spec.local_block_ids, spec.remote_block_ids, spec.first_block) == ([4], [50], 0)
    assert "error" not in spec.params


@pytest.mark.parametrize("change,cause", [
    ({"prompt_sha256": prompt_sha256([1, 2, 3])}, "prompt_mismatch"),
    ({"num_prompt_tokens": 41}, "prompt_mismatch"),
    ({"block_size": 32}, "layout"),
    ({"remote_block_ids": [100, 101]}, "layout"),  # fewer blocks than the prompt needs
    ({"remote_block_ids": None}, "layout"),
])
def test_params_that_do_not_fit_set_an_error(change, cause):
    conn = make_connector("kv_consumer")
    req = make_request("x", PROMPT, {**remote_params(PROMPT, [100, 101, 102]), **change})
    conn.update_state_after_alloc(req, [7, 8, 9], 39)
    spec = conn.build_connector_meta().reqs_to_load["x"]
    assert spec.params["error"] == cause
    assert "error" not in req.kv_transfer_params  # the request's own params untouched


def finished(req: Request, status: RequestStatus) -> Request:
    req.status = status
    return req


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_STOPPED,
                                    RequestStatus.FINISHED_LENGTH_CAPPED])
@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_producer_holds_a_finished_prompt(status, role):
    conn = make_connector(role)
    req = finished(make_request("p-1", PROMPT, {"do_remote_decode": True}), status)
    delay, params = conn.request_finished(req, [3, 4, 5])
    assert delay is True
    assert params == {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "lease_s": 30.0,
        "remote_request_id": "p-1", "remote_block_ids": [3, 4, 5], "block_size": 16,
        "num_prompt_tokens": 40, "prompt_sha256": prompt_sha256(PROMPT),
    }
    meta = conn.build_connector_meta()
    assert meta.reqs_to_hold == {"p-1": [3, 4, 5]}
    assert conn.build_connector_meta().is_empty


@pytest.mark.parametrize("role,params,status,blocks", [
    ("kv_producer", {"do_remote_decode": True}, RequestStatus.FINISHED_ABORTED, [3]),
    ("kv_producer", {"do_remote_decode": True}, RequestStatus.FINISHED_ERROR, [3]),
    ("kv_producer", {"do_remote_decode": True}, RequestStatus.FINISHED_STOPPED, []),
    ("kv_producer", None, RequestStatus.FINISHED_STOPPED, [3]),
    ("kv_producer", {"do_remote_decode": False}, RequestStatus.FINISHED_STOPPED, [3]),
    ("kv_consumer", {"do_remote_decode": True}, RequestStatus.FINISHED_STOPPED, [3]),
])
def test_producer_holds_nothing_otherwise(role, params, status, blocks):
    conn = make_connector(role)
    req = finished(make_request("p-1", PROMPT, params), status)
    assert conn.request_finished(req, blocks) == (False, None)
    assert conn.build_connector_meta().is_empty


def test_a_consumer_request_that_ends_before_loading_releases_its_producer():
    conn = make_connector("kv_consumer")
    params = remote_params(PROMPT, [100, 101, 102])
    req = make_request("x", PROMPT, params)
    conn.track_remote_request(req)
    assert conn.request_finished(finished(req, RequestStatus.FINISHED_ABORTED), []) == (
        False, None)
    assert req.kv_transfer_params is None
    meta = conn.build_connector_meta()
    assert meta == KVConnectorMetadata(reqs_to_release={"x": params})


# ---- streamed transfers ---------------------------------------------------------------------

def _scheduled(new=(), cached=(), preempted=()):
    from widellm.core.scheduler_output import (
        CachedRequestData, NewRequestData, SchedulerOutput,
    )
    new_reqs = [NewRequestData(rid, [], [], SamplingParams(), frozenset(), blocks, 0)
                for rid, blocks, _ in new]
    cached_data = CachedRequestData([rid for rid, _, _ in cached],
                                    [blocks for _, blocks, _ in cached], [0 for _ in cached])
    num = {rid: n for rid, _, n in (*new, *cached)}
    return SchedulerOutput(new_reqs, cached_data, num, sum(num.values()), set(), set(preempted))


def test_a_streamed_prompt_is_held_and_its_tokens_reported_every_step():
    conn = make_connector("kv_producer")
    req = make_request("p", PROMPT, {"do_remote_decode": True, "transfer_id": "t"})
    other = make_request("q", PROMPT, {"do_remote_decode": True})  # sequential: not streamed
    req.num_computed_tokens, other.num_computed_tokens = 32, 32  # after the schedule
    so = _scheduled(new=[("p", [4, 5], 32), ("q", [6, 7], 32)])
    conn.update_state_after_schedule(so, {"p": req, "q": other})
    assert so.kv_stream_tokens == {"p": 32}
    meta = conn.build_connector_meta()
    assert list(meta.reqs_to_stream) == ["p"]
    spec = meta.reqs_to_stream["p"]
    assert (spec.transfer_id, spec.new_block_ids, spec.num_prompt_tokens) == ("t", [4, 5], 40)
    assert spec.prompt_sha256 == prompt_sha256(PROMPT)
    req.num_computed_tokens = 40
    so = _scheduled(cached=[("p", [9], 8)])
    conn.update_state_after_schedule(so, {"p": req})
    assert so.kv_stream_tokens == {"p": 40}
    spec = conn.build_connector_meta().reqs_to_stream["p"]
    assert (spec.new_block_ids, spec.prompt_sha256) == ([9], "")  # registered already


def test_a_preempted_or_aborted_streamed_prompt_is_unstreamed():
    conn = make_connector("kv_producer")
    reqs = {rid: make_request(rid, PROMPT, {"do_remote_decode": True, "transfer_id": rid})
            for rid in ("a", "b")}
    conn.update_state_after_schedule(_scheduled(new=[("a", [1], 16), ("b", [2], 16)]), reqs)
    conn.build_connector_meta()
    conn.update_state_after_schedule(_scheduled(preempted=["a"]), reqs)
    assert conn.build_connector_meta().reqs_to_unstream == {"a"}
    reqs["b"].status = RequestStatus.FINISHED_ABORTED
    assert conn.request_finished(reqs["b"], [2]) == (False, None)
    assert conn.build_connector_meta().reqs_to_unstream == {"b"}


def test_a_streamed_consumer_request_sends_its_own_prompt_hash():
    conn = make_connector("kv_consumer")
    params = {"do_remote_prefill": True, **ENDPOINT, "transfer_id": "t",
              "remote_request_id": "t", "block_size": BLOCK_SIZE}
    req = make_request("x", PROMPT, params)
    conn.update_state_after_alloc(req, [7, 8, 9], 39)
    spec = conn.build_connector_meta().reqs_to_load["x"]
    assert (spec.remote_block_ids, spec.first_block, spec.num_tokens) == ([], 0, 39)
    assert spec.params["prompt_sha256"] == prompt_sha256(PROMPT)
    assert "error" not in spec.params
    req = make_request("y", PROMPT, {**params, "block_size": 32})
    conn.update_state_after_alloc(req, [7, 8, 9], 39)
    assert conn.build_connector_meta().reqs_to_load["y"].params["error"] == "layout"
