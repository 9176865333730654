"""Two TCPConnector worker halves in one process: a producer serving its KV cache on a
loopback side channel, a consumer pulling from it."""

import time

import pytest
import torch

from widellm.kv_transfer import faults, tcp_server
from widellm.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, LoadSpec
from widellm.kv_transfer.config import KVTransferConfig
from widellm.kv_transfer.tcp import TCPConnectorWorker

BLOCK_SIZE = 4
NUM_BLOCKS = 8
HEADS, HEAD_DIM = 2, 8
# One block of one layer: [2, 1, 4, 2, 8] fp32.
BLOCK_BYTES = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 4
NUM_LAYERS = 2
POLL_TIMEOUT_S = 5.0


def make_caches(seed: int, head_dim: int = HEAD_DIM) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, head_dim, generator=g)
            for _ in range(NUM_LAYERS)]


@pytest.fixture
def make_worker(monkeypatch):
    # Shutdown joins the accept thread, which looks for a close this often.
    monkeypatch.setattr(tcp_server, "ACCEPT_POLL_S", 0.05)
    workers = []

    def make(role: str, caches: list[torch.Tensor] | None = None, **extra) -> TCPConnectorWorker:
        extra = {"lease_s": 5.0, "transfer_timeout_s": 2.0, "heartbeat_interval_s": 0.2,
                 **extra}
        worker = TCPConnectorWorker(
            KVTransferConfig("TCPConnector", kv_role=role, kv_connector_extra_config=extra),
            BLOCK_SIZE, 0)
        workers.append(worker)
        if caches is not None:
            worker.register_kv_caches(caches, [1] * len(caches))
        return worker

    yield make
    for w in workers:
        w.shutdown()


@pytest.fixture
def producer(make_worker):
    worker = make_worker("kv_producer", make_caches(0))
    worker.start_load_kv(KVConnectorMetadata(reqs_to_hold={"r": [3, 5]}))
    return worker


@pytest.fixture
def consumer(make_worker):
    return make_worker("kv_consumer", make_caches(1))


def wait_for(worker, done, timeout_s: float = POLL_TIMEOUT_S) -> KVConnectorOutput:
    """Merge get_finished() until ``done(merged)``."""
    merged = KVConnectorOutput()
    deadline = time.monotonic() + timeout_s
    while True:
        out = worker.get_finished()
        merged.finished_sending |= out.finished_sending
        merged.finished_recving |= out.finished_recving
        merged.failed_recving.update(out.failed_recving)
        if done(merged):
            return merged
        if time.monotonic() > deadline:
            raise AssertionError(f"not done after {timeout_s} s: {merged}")
        time.sleep(0.01)


def load(consumer, local_id: str, params: dict, local=(0, 1), remote=(3, 5)) -> None:
    consumer.start_load_kv(KVConnectorMetadata(reqs_to_load={
        local_id: LoadSpec(dict(params), list(local), list(remote))}))


def pull_params(producer, remote_request_id: str = "r", **over) -> dict:
    return {"do_remote_prefill": True, **producer.transfer_params(),
            "remote_request_id": remote_request_id, **over}


def load_failure(consumer, local_id: str, params: dict, **kw) -> str:
    load(consumer, local_id, params, **kw)
    out = wait_for(consumer, lambda o: o.failed_recving or o.finished_recving)
    assert out.finished_recving == set()
    assert list(out.failed_recving) == [local_id]
    return out.failed_recving[local_id]


def test_transfer_params(producer, consumer):
    params = producer.transfer_params()
    assert set(params) == {"remote_engine_id", "remote_host", "remote_port", "lease_s"}
    assert params["remote_engine_id"].endswith("-dp0")
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] > 0
    assert params["lease_s"] == 5.0
    assert consumer.transfer_params() == {}  # a consumer serves nothing


def test_pull_round_trip(producer, consumer):
    before = [c.clone() for c in consumer.caches]
    assert producer.stats().num_requests_held == 1
    assert producer.stats().num_blocks_held == 2
    load(consumer, "x", pull_params(producer))
    out = wait_for(consumer, lambda o: o.finished_recving or o.failed_recving)
    assert out == KVConnectorOutput(finished_recving={"x"})
    for src, dst, old in zip(producer.caches, consumer.caches, before):
        assert torch.equal(dst[:, 0], src[:, 3])
        assert torch.equal(dst[:, 1], src[:, 5])
        assert torch.equal(dst[:, 2:], old[:, 2:])
    sent = wait_for(producer, lambda o: o.finished_sending)
    assert sent.finished_sending == {"r"}
    expected = NUM_LAYERS * 2 * BLOCK_BYTES
    assert expected == 2048
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while producer.stats().num_sends == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    p, c = producer.stats(), consumer.stats()
    assert (p.bytes_sent, p.num_sends, p.send_failures) == (expected, 1, {})
    assert (p.num_requests_held, p.num_blocks_held, p.leases_expired) == (0, 0, 0)
    assert (c.bytes_received, c.num_loads, c.failures) == (expected, 1, {})
    assert consumer.get_block_ids_with_load_errors() == set()
    # The hold ended with the pull: a second pull is refused.
    assert load_failure(consumer, "x2", pull_params(producer)) == "unknown_request"


def test_pull_of_an_unknown_request(producer, consumer):
    assert load_failure(consumer, "y", pull_params(producer, "nope")) == "unknown_request"
    assert consumer.get_block_ids_with_load_errors() == {0, 1}
    assert consumer.get_block_ids_with_load_errors() == set()
    assert consumer.stats().failures == {"unknown_request": 1}
    assert producer.stats().num_requests_held == 1  # "r" untouched


def test_pull_of_blocks_the_request_does_not_hold(producer, consumer):
    assert load_failure(consumer, "y", pull_params(producer), remote=(3, 4)) == "layout"


def test_pull_from_another_engine(producer, consumer):
    params = pull_params(producer, remote_engine_id="someone-else-dp0")
    assert load_failure(consumer, "y", params) == "engine_mismatch"


def test_pull_from_a_producer_that_shut_down(producer, consumer):
    params = pull_params(producer)
    producer.shutdown()
    assert load_failure(consumer, "y", params) == "connection"
    assert consumer.stats().failures == {"connection": 1}


def test_pull_into_another_layout(producer, make_worker):
    consumer = make_worker("kv_consumer", make_caches(1, head_dim=4))
    before = [c.clone() for c in consumer.caches]
    assert load_failure(consumer, "y", pull_params(producer)) == "layout"
    assert all(torch.equal(a, b) for a, b in zip(consumer.caches, before))
    # Whatever broke it off, the hold ends with the pull.
    assert wait_for(producer, lambda o: o.finished_sending).finished_sending == {"r"}


def test_params_with_an_error_fail_at_once(producer, consumer):
    params = pull_params(producer, error="prompt_mismatch")
    assert load_failure(consumer, "y", params) == "prompt_mismatch"
    assert producer.stats().num_requests_held == 1  # nobody pulled


@pytest.mark.parametrize("fault,cause", [("corrupt", "checksum"), ("short", "short_payload"),
                                         ("stall:1.0", "timeout")])
def test_faults(producer, make_worker, tmp_path, monkeypatch, fault, cause):
    consumer = make_worker("kv_consumer", make_caches(1), transfer_timeout_s=0.4)
    fault_file = tmp_path / "fault"
    fault_file.write_text(fault)
    monkeypatch.setenv(faults.FAULT_FILE_ENV, str(fault_file))
    original = [c.clone() for c in producer.caches]
    assert load_failure(consumer, "y", pull_params(producer)) == cause
    assert consumer.stats().failures == {cause: 1}
    assert consumer.get_block_ids_with_load_errors() == {0, 1}
    # The fault is on the wire: the producer's own cache is intact.
    assert all(torch.equal(a, b) for a, b in zip(producer.caches, original))


def test_unknown_fault_name_is_refused(tmp_path, monkeypatch):
    fault_file = tmp_path / "fault"
    fault_file.write_text("melt")
    monkeypatch.setenv(faults.FAULT_FILE_ENV, str(fault_file))
    with pytest.raises(ValueError, match="unknown fault 'melt'"):
        faults.current_fault()
    fault_file.write_text("stall:2.5")
    assert faults.current_fault() == ("stall", 2.5)
    fault_file.unlink()
    assert faults.current_fault() == ("", 0.0)


def test_heartbeat_for_a_request_the_producer_does_not_hold_fails_it(producer, consumer):
    start = time.monotonic()
    consumer.start_load_kv(KVConnectorMetadata(
        reqs_to_track={"t": pull_params(producer, "gone")}))
    out = wait_for(consumer, lambda o: o.failed_recving, timeout_s=1.5)
    assert out.failed_recving == {"t": "unknown_request"}
    assert time.monotonic() - start < 1.0
    # Its load, when the scheduler started one anyway, reports nothing a second time.
    load(consumer, "t", pull_params(producer, "gone"))
    time.sleep(0.3)
    assert consumer.get_finished().is_empty


def test_heartbeat_to_a_restarted_producer_fails_it(producer, consumer):
    consumer.start_load_kv(KVConnectorMetadata(
        reqs_to_track={"t": pull_params(producer, remote_engine_id="old-dp0")}))
    out = wait_for(consumer, lambda o: o.failed_recving, timeout_s=1.5)
    assert out.failed_recving == {"t": "engine_mismatch"}


def test_heartbeats_keep_a_short_lease_alive(make_worker, consumer):
    producer = make_worker("kv_producer", make_caches(0), lease_s=0.6)
    producer.start_load_kv(KVConnectorMetadata(reqs_to_hold={"r": [3, 5]}))
    consumer.start_load_kv(KVConnectorMetadata(reqs_to_track={"x": pull_params(producer)}))
    time.sleep(1.2)  # two leases
    assert producer.get_finished().finished_sending == set()
    assert producer.stats().num_requests_held == 1
    assert consumer.get_finished().is_empty
    load(consumer, "x", pull_params(producer))
    assert wait_for(consumer, lambda o: o.finished_recving or o.failed_recving
                    ) == KVConnectorOutput(finished_recving={"x"})
    assert producer.stats().leases_expired == 0


def test_an_untended_lease_expires(make_worker):
    producer = make_worker("kv_producer", make_caches(0), lease_s=0.2)
    producer.start_load_kv(KVConnectorMetadata(reqs_to_hold={"r": [3, 5]}))
    assert producer.get_finished().finished_sending == set()
    time.sleep(0.3)
    assert producer.get_finished().finished_sending == {"r"}
    s = producer.stats()
    assert (s.leases_expired, s.num_requests_held, s.num_blocks_held) == (1, 0, 0)


def test_release_ends_the_hold(producer, consumer):
    consumer.start_load_kv(KVConnectorMetadata(
        reqs_to_track={"x": pull_params(producer)},
        reqs_to_release={"x": pull_params(producer)}))
    assert wait_for(producer, lambda o: o.finished_sending).finished_sending == {"r"}
    assert producer.stats().leases_expired == 0
    time.sleep(0.3)  # released means no longer tracked: no heartbeat failure follows
    assert consumer.get_finished().is_empty
