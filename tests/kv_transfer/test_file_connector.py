"""FileConnector's worker half: a producer writes a finished prompt's blocks into a folder,
a consumer loads them from it."""

import os
import re
import time

import msgspec
import pytest
import torch

from tests.kv_transfer.test_tcp_connector import wait_for
from widellm.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, LoadSpec
from widellm.kv_transfer.config import KVTransferConfig
from widellm.kv_transfer.file_connector import FileConnectorWorker, kv_file
from widellm.kv_transfer.kv_layout import describe

BLOCK_SIZE = 4
NUM_BLOCKS = 8
HEADS, HEAD_DIM = 2, 8
BLOCK_BYTES = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 4  # one block of one fp32 MHA layer
NUM_LAYERS = 2
HELD = [3, 5, 6]


def make_caches(seed: int, head_dim: int = HEAD_DIM) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, head_dim, generator=g)
            for _ in range(NUM_LAYERS)]


@pytest.fixture
def make_worker(tmp_path):
    workers = []

    def make(role: str, caches: list[torch.Tensor], **extra) -> FileConnectorWorker:
        config = KVTransferConfig("FileConnector", kv_role=role, kv_connector_extra_config={
            "path": str(tmp_path / "kv"), **extra})
        worker = FileConnectorWorker(config, BLOCK_SIZE, 0)
        workers.append(worker)
        worker.register_kv_caches(caches, [1] * len(caches))
        return worker

    yield make
    for w in workers:
        w.shutdown()


def ended(out: KVConnectorOutput) -> bool:
    return bool(out.finished_recving or out.failed_recving)


@pytest.fixture
def producer(make_worker):
    worker = make_worker("kv_producer", make_caches(0))
    worker.start_load_kv(KVConnectorMetadata(reqs_to_hold={"r": HELD}))
    assert wait_for(worker, lambda o: o.finished_sending) == KVConnectorOutput(
        finished_sending={"r"})
    return worker


def params_of(producer, **over) -> dict:
    return {"do_remote_prefill": True, **producer.transfer_params(), "remote_request_id": "r",
            "remote_block_ids": HELD, **over}


def test_producer_writes_the_file_and_lets_the_blocks_go(producer, tmp_path):
    path = kv_file(params_of(producer))
    assert os.path.dirname(path) == str(tmp_path / "kv")
    assert os.path.basename(path) == f"{producer.engine_id}-r.kv"
    header = msgspec.msgpack.encode({"ok": True, "layout": describe(producer.caches,
                                                                     producer.block_dims)})
    expected_payload = NUM_LAYERS * len(HELD) * BLOCK_BYTES
    assert os.path.getsize(path) == 4 + len(header) + NUM_LAYERS * 12 + expected_payload
    assert not os.path.exists(path + ".tmp")
    s = producer.stats()
    assert (s.bytes_sent, s.num_sends, s.send_failures) == (expected_payload, 1, {})
    assert (s.num_requests_held, s.num_blocks_held) == (0, 0)


def test_consumer_loads_the_exact_bytes_and_deletes_the_file(producer, make_worker):
    consumer = make_worker("kv_consumer", make_caches(1))
    before = [c.clone() for c in consumer.caches]
    params = params_of(producer)
    consumer.start_load_kv(KVConnectorMetadata(reqs_to_load={
        "x": LoadSpec(params, [0, 1, 2], HELD, 0)}))
    assert wait_for(consumer, ended) == KVConnectorOutput(finished_recving={"x"})
    for src, dst, old in zip(producer.caches, consumer.caches, before):
        assert torch.equal(dst[:, 0:3], src[:, HELD])
        assert torch.equal(dst[:, 3:], old[:, 3:])
    assert not os.path.exists(kv_file(params))
    s = consumer.stats()
    assert (s.bytes_received, s.num_loads, s.failures) == (NUM_LAYERS * 3 * BLOCK_BYTES, 1, {})


def test_consumer_loads_a_prompt_tail(producer, make_worker):
    # Block 0 of the prompt was a local prefix hit: blocks 1 and 2 come from the file.
    consumer = make_worker("kv_consumer", make_caches(1))
    before = [c.clone() for c in consumer.caches]
    consumer.start_load_kv(KVConnectorMetadata(reqs_to_load={
        "x": LoadSpec(params_of(producer), [6, 7], [5, 6], 1)}))
    assert wait_for(consumer, ended) == KVConnectorOutput(finished_recving={"x"})
    for src, dst, old in zip(producer.caches, consumer.caches, before):
        assert torch.equal(dst[:, 6], src[:, 5])
        assert torch.equal(dst[:, 7], src[:, 6])
        assert torch.equal(dst[:, :6], old[:, :6])
    assert consumer.stats().bytes_received == NUM_LAYERS * 2 * BLOCK_BYTES


def test_a_file_that_never_appears_is_a_timeout(make_worker):
    consumer = make_worker("kv_consumer", make_caches(1), transfer_timeout_s=0.1)
    params = {"do_remote_prefill": True, "remote_engine_id": "nobody-dp0",
              "kv_dir": consumer.dir, "remote_request_id": "r", "remote_block_ids": HELD}
    start = time.monotonic()
    consumer.start_load_kv(KVConnectorMetadata(reqs_to_load={
        "x": LoadSpec(params, [0, 1, 2], HELD, 0)}))
    assert wait_for(consumer, ended) == KVConnectorOutput(failed_recving={"x": "timeout"})
    assert time.monotonic() - start < 2.0
    assert consumer.stats().failures == {"timeout": 1}


def test_a_file_of_another_layout(producer, make_worker):
    consumer = make_worker("kv_consumer", make_caches(1, head_dim=4))
    params = params_of(producer)
    consumer.start_load_kv(KVConnectorMetadata(reqs_to_load={
        "x": LoadSpec(params, [0, 1, 2], HELD, 0)}))
    assert wait_for(consumer, ended) == KVConnectorOutput(failed_recving={"x": "layout"})
    assert os.path.exists(kv_file(params))  # not consumed


def test_params_with_an_error_fail_at_once(producer, make_worker):
    consumer = make_worker("kv_consumer", make_caches(1))
    consumer.start_load_kv(KVConnectorMetadata(reqs_to_load={
        "x": LoadSpec(params_of(producer, error="prompt_mismatch"), [0, 1, 2], HELD, 0)}))
    assert wait_for(consumer, ended) == KVConnectorOutput(
        failed_recving={"x": "prompt_mismatch"})


def test_path_is_required():
    with pytest.raises(ValueError,
                       match=re.escape('needs kv_connector_extra_config {"path": DIR}')):
        FileConnectorWorker(KVTransferConfig("FileConnector"), BLOCK_SIZE, 0)
