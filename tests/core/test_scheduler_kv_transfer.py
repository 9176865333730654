"""The scheduler's remote-KV states, driven without a model or a transport: a real
PullConnectorScheduler decides, hand-made KVConnectorOutputs stand in for the worker half."""

import pytest

from widellm.config import CacheConfig, SchedulerConfig
from widellm.core.outputs import EngineCoreOutput, ModelRunnerOutput
from widellm.core.request import Request, RequestStatus
from widellm.core.scheduler import Scheduler
from widellm.kv_transfer.base import KVConnectorOutput, LoadSpec
from widellm.kv_transfer.config import KVTransferConfig
from widellm.kv_transfer.pull_scheduler import PullConnectorScheduler, prompt_sha256
from widellm.sampling_params import SamplingParams

BLOCK_SIZE = 16
NUM_BLOCKS = 32
EOS = 2
TOKEN = 7
ENDPOINT = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "lease_s": 30.0}
PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks, the first 39 tokens are loaded
OTHER = list(range(300, 320))  # 20 tokens: 2 blocks
REMOTE_BLOCKS = [100, 101, 102]


def make_scheduler(role: str = "kv_consumer", policy: str = "recompute") -> Scheduler:
    config = KVTransferConfig("TCPConnector", kv_role=role, kv_load_failure_policy=policy)
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        NUM_BLOCKS,
        PullConnectorScheduler(config, BLOCK_SIZE, lambda: dict(ENDPOINT)),
        policy,
    )


def remote_params(prompt: list[int]) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, **ENDPOINT,
            "remote_request_id": "p-" + str(len(prompt)), "remote_block_ids": REMOTE_BLOCKS,
            "block_size": BLOCK_SIZE, "num_prompt_tokens": len(prompt),
            "prompt_sha256": prompt_sha256(prompt)}


def make_request(req_id: str, prompt: list[int], params: dict | None = None,
                 max_tokens: int = 8) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), frozenset({EOS}),
                   max_tokens, kv_transfer_params=params)


def sample(sched: Scheduler, out, tokens: dict[str, int] | None = None
           ) -> dict[str, EngineCoreOutput]:
    """One token for every scheduled request that reached the end of its known tokens."""
    tokens = tokens or {}
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = sched.requests.get(rid)
        sampled.append([tokens.get(rid, TOKEN)] if req is None
                       or req.num_computed_tokens == req.num_tokens else [])
    outputs = sched.update_from_output(
        out, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled))
    return {o.request_id: o for o in outputs}


def free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.num_free_blocks


def park(sched: Scheduler, with_other: bool = True):
    """Add the consumer request "x" (and an ordinary "o"), schedule once."""
    x = make_request("x", PROMPT, remote_params(PROMPT))
    sched.add_request(x)
    if with_other:
        sched.add_request(make_request("o", OTHER))
    return x, sched.schedule()


# ---- consumer ---------------------------------------------------------------------------


def test_consumer_request_parks_while_an_ordinary_one_runs():
    sched = make_scheduler()
    x, out = park(sched)
    assert x.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched.kv_cache_manager.get_block_ids("x") == [0, 1, 2]
    assert x.num_computed_tokens == 0 and x.num_external_tokens == 39
    assert out.num_scheduled_tokens == {"o": 20}
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [
        ("o", [3, 4], 0)]
    assert free_blocks(sched) == NUM_BLOCKS - 5
    assert list(sched.waiting) == [] and [r.request_id for r in sched.running] == ["o"]
    assert sched.has_pending_kv_transfers()
    meta = sched.kv_connector.build_connector_meta()
    assert meta.reqs_to_load == {"x": LoadSpec(remote_params(PROMPT), [0, 1, 2],
                                               REMOTE_BLOCKS, 0, 39)}
    assert meta.reqs_to_track == {"x": remote_params(PROMPT)}
    assert meta.reqs_to_hold == {} and meta.reqs_to_release == {}
    # Nothing more to do for it until the load ends.
    sample(sched, out)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"o": 1}
    assert sched.kv_connector.build_connector_meta().is_empty


def test_blocks_being_loaded_are_not_prefix_hits():
    sched = make_scheduler()
    park(sched, with_other=False)
    sched.add_request(make_request("twin", PROMPT))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"twin": 40}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.scheduled_new_reqs[0].block_ids == [3, 4, 5]


def test_a_loaded_request_resumes_with_its_prompt_computed_but_one_token():
    sched = make_scheduler()
    x, out = park(sched)
    sample(sched, out)
    sched.kv_connector.build_connector_meta()
    assert sched.update_from_kv_connector(KVConnectorOutput(finished_recving={"x"})) == []
    assert x.status == RequestStatus.WAITING
    assert x.num_computed_tokens == 39
    assert x.kv_transfer_params is None
    assert list(sched.waiting) == [x]
    assert not sched.has_pending_kv_transfers()
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"o": 1, "x": 1}
    [new] = out.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("x", [0, 1, 2], 39)
    assert sched.kv_connector.build_connector_meta().is_empty  # nothing to load again
    outputs = sample(sched, out)
    assert outputs["x"].new_token_ids == [TOKEN]
    assert outputs["x"].num_cached_tokens == 0  # no local hit
    # Its two full blocks are in the prefix cache now.
    sched.add_request(make_request("twin", PROMPT))
    out = sched.schedule()
    new = next(n for n in out.scheduled_new_reqs if n.req_id == "twin")
    assert new.num_computed_tokens == 32
    assert new.block_ids[:2] == [0, 1]
    assert out.num_scheduled_tokens["twin"] == 8


def test_a_local_hit_loads_only_the_tail():
    sched = make_scheduler()
    # An ordinary run of the first 16 tokens leaves block 0 cached.
    sched.add_request(make_request("warm", PROMPT[:20], max_tokens=1))
    outputs = sample(sched, sched.schedule())
    assert outputs["warm"].finish_reason == "length"
    assert free_blocks(sched) == NUM_BLOCKS
    x, out = park(sched, with_other=False)
    assert out.num_scheduled_tokens == {}
    assert x.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert (x.num_computed_tokens, x.num_external_tokens, x.num_cached_tokens) == (16, 23, 16)
    assert sched.kv_cache_manager.get_block_ids("x") == [0, 2, 3]
    meta = sched.kv_connector.build_connector_meta()
    assert meta.reqs_to_load == {"x": LoadSpec(remote_params(PROMPT), [2, 3], [101, 102], 1, 39)}
    sched.update_from_kv_connector(KVConnectorOutput(finished_recving={"x"}))
    assert x.num_computed_tokens == 39
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"x": 1}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 39


def test_failed_load_under_recompute_frees_and_recomputes_from_zero():
    sched = make_scheduler(policy="recompute")
    x, out = park(sched)
    sample(sched, out)
    sched.kv_connector.build_connector_meta()
    assert free_blocks(sched) == NUM_BLOCKS - 5
    assert sched.update_from_kv_connector(
        KVConnectorOutput(failed_recving={"x": "checksum"})) == []
    assert free_blocks(sched) == NUM_BLOCKS - 2
    assert sched.kv_cache_manager.get_block_ids("x") == []
    assert (x.status, x.num_computed_tokens, x.num_external_tokens) == (
        RequestStatus.WAITING, 0, 0)
    assert x.kv_transfer_params is None
    assert sched.num_recomputed == 1
    assert not sched.has_pending_kv_transfers()
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"o": 1, "x": 40}
    [new] = out.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens) == ("x", 0)
    assert len(new.block_ids) == 3
    assert sched.kv_connector.build_connector_meta().is_empty  # no second load


def test_failed_load_under_fail_ends_the_request_with_an_error():
    sched = make_scheduler(policy="fail")
    x, out = park(sched)
    sample(sched, out)
    outputs = sched.update_from_kv_connector(KVConnectorOutput(failed_recving={"x": "timeout"}))
    assert outputs == [EngineCoreOutput(
        request_id="x", new_token_ids=[], finish_reason="error",
        stop_reason="loading the prompt's KV from the prefill instance failed (timeout)")]
    assert x.status == RequestStatus.FINISHED_ERROR
    assert "x" not in sched.requests
    assert free_blocks(sched) == NUM_BLOCKS - 2
    assert sched.num_recomputed == 0
    assert not sched.has_pending_kv_transfers()
    out = sched.schedule()
    assert out.finished_req_ids == {"x"}
    assert out.num_scheduled_tokens == {"o": 1}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failure_before_admission_follows_the_policy(policy):
    # A heartbeat found the producer gone while the request still waited for admission.
    sched = make_scheduler(policy=policy)
    x = make_request("x", PROMPT, remote_params(PROMPT))
    sched.add_request(x)
    outputs = sched.update_from_kv_connector(
        KVConnectorOutput(failed_recving={"x": "unknown_request"}))
    assert x.kv_transfer_params is None
    if policy == "recompute":
        assert outputs == []
        assert list(sched.waiting) == [x] and x.status == RequestStatus.WAITING
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"x": 40}
    else:
        assert [(o.request_id, o.finish_reason, o.stop_reason) for o in outputs] == [
            ("x", "error",
             "loading the prompt's KV from the prefill instance failed (unknown_request)")]
        assert list(sched.waiting) == [] and "x" not in sched.requests
        assert sched.schedule().finished_req_ids == {"x"}
    assert free_blocks(sched) == NUM_BLOCKS - (3 if policy == "recompute" else 0)


def test_reports_for_unknown_or_running_requests_change_nothing():
    sched = make_scheduler(policy="fail")
    sched.add_request(make_request("o", OTHER))
    sample(sched, sched.schedule())
    assert sched.update_from_kv_connector(KVConnectorOutput(
        finished_sending={"ghost"}, finished_recving={"ghost2"},
        failed_recving={"o": "checksum", "ghost3": "timeout"})) == []
    assert sched.requests["o"].status == RequestStatus.RUNNING
    assert free_blocks(sched) == NUM_BLOCKS - 2


@pytest.mark.parametrize("report", [KVConnectorOutput(finished_recving={"x"}),
                                    KVConnectorOutput(failed_recving={"x": "connection"})],
                         ids=["finished", "failed"])
def test_abort_while_loading_frees_the_blocks_only_when_the_load_ends(report):
    sched = make_scheduler(policy="fail")
    x, out = park(sched)
    sample(sched, out)
    sched.kv_connector.build_connector_meta()
    sched.abort_requests(["x"])
    assert x.status == RequestStatus.FINISHED_ABORTED
    assert "x" not in sched.requests
    assert free_blocks(sched) == NUM_BLOCKS - 5  # the load may still write into them
    assert sched.kv_cache_manager.get_block_ids("x") == [0, 1, 2]
    assert sched.has_pending_kv_transfers()
    out = sched.schedule()
    assert out.finished_req_ids == {"x"}
    assert sched.update_from_kv_connector(report) == []  # no output for an aborted request
    assert free_blocks(sched) == NUM_BLOCKS - 2
    assert not sched.has_pending_kv_transfers()
    assert list(sched.waiting) == []


def test_an_id_still_loading_after_an_abort_is_refused():
    sched = make_scheduler()
    park(sched, with_other=False)
    sched.abort_requests(["x"])
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("x", OTHER))


def test_a_loaded_request_preempted_later_rehits_its_cached_prompt():
    config = KVTransferConfig("TCPConnector", kv_role="kv_consumer")
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True), 5,
        PullConnectorScheduler(config, BLOCK_SIZE, lambda: dict(ENDPOINT)), "recompute")
    sched.add_request(make_request("o", list(range(300, 331))))  # 31 tokens: blocks 0, 1
    sched.add_request(make_request("x", PROMPT, remote_params(PROMPT)))  # blocks 2, 3, 4
    sample(sched, sched.schedule())
    sched.update_from_kv_connector(KVConnectorOutput(finished_recving={"x"}))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"o": 1, "x": 1}
    sample(sched, out)
    out = sched.schedule()  # o needs a third block: x, the latest admitted, is preempted
    assert out.preempted_req_ids == {"x"}
    sample(sched, out)
    sched.abort_requests(["o"])
    out = sched.schedule()
    [new] = out.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("x", [2, 3, 4], 32)


def test_abort_of_a_waiting_consumer_request_releases_its_producer():
    sched = make_scheduler()
    sched.add_request(make_request("busy", OTHER))
    x = make_request("x", PROMPT, remote_params(PROMPT))
    sched.add_request(x)
    sched.abort_requests(["x"])
    meta = sched.kv_connector.build_connector_meta()
    assert meta.reqs_to_release == {"x": remote_params(PROMPT)}
    assert meta.reqs_to_track == {}  # tracked at add, dropped at release
    assert not sched.has_pending_kv_transfers()


# ---- producer ---------------------------------------------------------------------------


@pytest.mark.parametrize("eos", [False, True], ids=["length", "stop"])
def test_producer_holds_a_finished_prompt_until_it_is_sent(eos):
    sched = make_scheduler(role="kv_producer")
    sched.add_request(make_request("p", PROMPT, {"do_remote_decode": True}, max_tokens=1))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"p": 40}
    assert free_blocks(sched) == NUM_BLOCKS - 3
    outputs = sample(sched, out, {"p": EOS} if eos else None)
    assert free_blocks(sched) == NUM_BLOCKS - 3  # held for the consumer
    o = outputs["p"]
    assert o.finish_reason == ("stop" if eos else "length")
    assert o.new_token_ids == [EOS if eos else TOKEN]
    assert o.kv_transfer_params == {
        "do_remote_prefill": True, "do_remote_decode": False, **ENDPOINT,
        "remote_request_id": "p", "remote_block_ids": [0, 1, 2], "block_size": BLOCK_SIZE,
        "num_prompt_tokens": 40, "prompt_sha256": prompt_sha256(PROMPT)}
    assert "p" not in sched.requests and not sched.has_unfinished_requests()
    assert sched.has_pending_kv_transfers()
    assert sched.kv_connector.build_connector_meta().reqs_to_hold == {"p": [0, 1, 2]}
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("p", PROMPT))
    sched.update_from_kv_connector(KVConnectorOutput(finished_sending={"p"}))
    assert free_blocks(sched) == NUM_BLOCKS
    assert not sched.has_pending_kv_transfers()
    # Freed blocks stay prefix-cached for a local rerun.
    sched.add_request(make_request("p", PROMPT))
    assert sched.schedule().scheduled_new_reqs[0].num_computed_tokens == 32


def test_producer_frees_an_aborted_or_ordinary_request_at_once():
    sched = make_scheduler(role="kv_producer")
    sched.add_request(make_request("p", PROMPT, {"do_remote_decode": True}))
    sched.add_request(make_request("q", OTHER, max_tokens=1))
    outputs = sample(sched, sched.schedule())
    assert outputs["q"].finish_reason == "length" and outputs["q"].kv_transfer_params is None
    assert free_blocks(sched) == NUM_BLOCKS - 3
    sched.abort_requests(["p"])
    assert free_blocks(sched) == NUM_BLOCKS
    assert not sched.has_pending_kv_transfers()
    assert sched.kv_connector.build_connector_meta().is_empty
