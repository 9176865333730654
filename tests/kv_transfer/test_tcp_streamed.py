"""Streamed pulls between two TCPConnector worker halves in one process: the consumer asks
for a prompt before the producer has computed it, and gets each layer as soon as the
producer's forward wrote it."""

import time

import pytest
import torch

from widellm.kv_transfer.base import KVConnectorMetadata, LoadSpec, StreamSpec
from widellm.kv_transfer.pull_scheduler import prompt_sha256

from tests.kv_transfer.test_tcp_connector import (  # noqa: F401  (fixtures)
    BLOCK_SIZE, NUM_LAYERS, POLL_TIMEOUT_S, make_caches, make_worker, wait_for,
)

PROMPT = list(range(100, 110))  # 10 tokens: blocks 0-2 of 4 tokens; the consumer loads 9
SHA = prompt_sha256(PROMPT)
PRODUCER_BLOCKS = [6, 2, 4]
CONSUMER_BLOCKS = [1, 3, 5]


def stream_params(producer, **overrides) -> dict:
    ep = producer.transfer_params()
    return {"do_remote_prefill": True, "transfer_id": "t1", "remote_request_id": "t1",
            "remote_engine_id": ep["remote_engine_id"], "remote_host": ep["remote_host"],
            "remote_port": ep["remote_port"], "block_size": BLOCK_SIZE,
            "prompt_sha256": SHA, **overrides}


def start_pull(consumer, params: dict) -> None:
    consumer.start_load_kv(KVConnectorMetadata(reqs_to_load={
        "d1": LoadSpec(params, CONSUMER_BLOCKS, [], 0, len(PROMPT) - 1)}))


def schedule(producer, rid: str = "p1") -> None:
    producer.start_load_kv(KVConnectorMetadata(reqs_to_stream={
        rid: StreamSpec("t1", PRODUCER_BLOCKS, SHA, len(PROMPT))}))


def write_layer(caches: list[torch.Tensor], layer: int, value: float) -> None:
    caches[layer][:, PRODUCER_BLOCKS] = value


def wait_until(check, timeout_s: float = POLL_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def pair(make_worker):
    p_caches = [torch.zeros_like(c) for c in make_caches(0)]
    c_caches = make_caches(1)
    producer = make_worker("kv_producer", p_caches)
    consumer = make_worker("kv_consumer", c_caches)
    return producer, p_caches, consumer, c_caches


def test_each_layer_arrives_while_the_later_layers_are_still_unwritten(pair):
    producer, p_caches, consumer, c_caches = pair
    start_pull(consumer, stream_params(producer))  # before the prompt is even scheduled
    time.sleep(0.1)
    schedule(producer)
    producer.begin_forward({"p1": len(PROMPT)}, 1)
    for layer in range(NUM_LAYERS):
        write_layer(p_caches, layer, layer + 1.0)
        producer.save_kv_layer(str(layer), p_caches[layer], None)
        # The consumer has this layer before the producer writes the next one.
        wait_until(lambda: bool((c_caches[layer][:, CONSUMER_BLOCKS] == layer + 1.0).all()))
        if layer + 1 < NUM_LAYERS:
            assert not (c_caches[layer + 1][:, CONSUMER_BLOCKS] == layer + 2.0).any()
    producer.end_forward()
    out = wait_for(consumer, lambda m: "d1" in m.finished_recving)
    assert out.failed_recving == {}
    for layer in range(NUM_LAYERS):
        assert torch.equal(c_caches[layer][:, CONSUMER_BLOCKS], p_caches[layer][:, PRODUCER_BLOCKS])
    # The pull ended while the prompt ran: its blocks are freed only once it finished.
    time.sleep(0.1)
    assert producer.get_finished().finished_sending == set()
    producer.start_load_kv(KVConnectorMetadata(reqs_to_hold={"p1": PRODUCER_BLOCKS}))
    assert wait_for(producer, lambda m: "p1" in m.finished_sending).finished_sending == {"p1"}
    assert producer.stats().num_sends == 1 and consumer.stats().num_loads == 1


def test_chunked_prompt_waits_for_the_chunk_that_completes_it(pair):
    producer, p_caches, consumer, c_caches = pair
    schedule(producer)
    start_pull(consumer, stream_params(producer))
    producer.begin_forward({"p1": 4}, 1)  # the first chunk: 4 of 10 tokens
    for layer in range(NUM_LAYERS):
        write_layer(p_caches, layer, 7.0)
        producer.save_kv_layer(str(layer), p_caches[layer], None)
    producer.end_forward()
    time.sleep(0.2)
    assert consumer.get_finished().finished_recving == set()
    assert not (c_caches[0][:, CONSUMER_BLOCKS] == 7.0).all()
    producer.begin_forward({"p1": 10}, 2)  # the last chunk, as two micro-batches
    for layer in range(NUM_LAYERS):
        producer.save_kv_layer(str(layer), p_caches[layer], None)
    assert not (c_caches[0][:, CONSUMER_BLOCKS] == 7.0).all()  # one of two passes so far
    for layer in range(NUM_LAYERS):
        producer.save_kv_layer(str(layer), p_caches[layer], None)
    producer.end_forward()
    wait_for(consumer, lambda m: "d1" in m.finished_recving)
    assert (c_caches[1][:, CONSUMER_BLOCKS] == 7.0).all()


def test_a_pull_for_another_prompt_is_refused(pair):
    producer, _, consumer, _ = pair
    schedule(producer)
    start_pull(consumer, stream_params(producer, prompt_sha256="0" * 64))
    out = wait_for(consumer, lambda m: "d1" in m.failed_recving)
    assert out.failed_recving == {"d1": "prompt_mismatch"}


def test_an_abort_mid_stream_fails_the_pull_with_its_cause(pair):
    producer, p_caches, consumer, c_caches = pair
    schedule(producer)
    start_pull(consumer, stream_params(producer))
    producer.begin_forward({"p1": len(PROMPT)}, 1)
    write_layer(p_caches, 0, 3.0)
    producer.save_kv_layer("0", p_caches[0], None)
    wait_until(lambda: bool((c_caches[0][:, CONSUMER_BLOCKS] == 3.0).all()))
    producer.start_load_kv(KVConnectorMetadata(reqs_to_unstream={"p1"}))
    out = wait_for(consumer, lambda m: "d1" in m.failed_recving)
    assert out.failed_recving == {"d1": "unknown_request"}
    producer.end_forward()
    # The cancelled hold ends (the scheduler freed the blocks itself): nothing stays held.
    wait_for(producer, lambda m: "p1" in m.finished_sending)
    assert producer.stats().num_requests_held == 0


def test_a_prompt_never_scheduled_times_out(make_worker):
    producer = make_worker("kv_producer", make_caches(0), transfer_timeout_s=0.3)
    consumer = make_worker("kv_consumer", make_caches(1), transfer_timeout_s=0.3)
    start_pull(consumer, stream_params(producer))
    out = wait_for(consumer, lambda m: "d1" in m.failed_recving)
    assert out.failed_recving == {"d1": "timeout"}


def test_a_release_before_the_prompt_is_scheduled_ends_its_hold_when_it_finishes(pair):
    producer, _, consumer, _ = pair
    params = stream_params(producer)
    consumer.start_load_kv(KVConnectorMetadata(reqs_to_release={"d1": params}))
    wait_until(lambda: producer.streams.take_early_release("t1") or False)
    producer.streams.release_early("t1")  # (taken by the check above: put it back)
    schedule(producer)
    producer.start_load_kv(KVConnectorMetadata(reqs_to_hold={"p1": PRODUCER_BLOCKS}))
    assert wait_for(producer, lambda m: "p1" in m.finished_sending).finished_sending == {"p1"}
    assert producer.stats().leases_expired == 0
