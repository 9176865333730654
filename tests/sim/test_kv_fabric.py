"""The simulated KV fabric's links: one per rank, held at both ends of a transfer, first come
first served. Exact end times with a transfer of 1 s per 100 tokens."""

from __future__ import annotations

import pytest

from widellm.kv_transfer.config import KVTransferConfig
from widellm.sim.clock import VirtualClock
from widellm.sim.kv_fabric import SIM_CONNECTOR_NAME, SimKVFabric

SECONDS_PER_TOKEN = 0.01


def _fabric() -> SimKVFabric:
    return SimKVFabric(VirtualClock(), lambda num_tokens: num_tokens * SECONDS_PER_TOKEN)


def _load(fabric: SimKVFabric, producer: str, consumer: str, req: str, tokens: int) -> float:
    params = {"remote_engine_id": producer, "remote_request_id": f"{producer}-{req}"}
    return fabric.start_load(consumer, req, params, tokens)


def test_disjoint_pairs_move_at_once_shared_ends_queue():
    fabric = _fabric()
    assert _load(fabric, "p0", "d0", "a", 100) == pytest.approx(1.0)
    assert _load(fabric, "p1", "d1", "b", 200) == pytest.approx(2.0)  # other links: at once
    assert _load(fabric, "p0", "d1", "c", 100) == pytest.approx(3.0)  # waits for d1 (2.0)
    assert _load(fabric, "p1", "d0", "d", 50) == pytest.approx(2.5)  # waits for p1 (2.0)
    assert _load(fabric, "p0", "d0", "e", 100) == pytest.approx(4.0)  # p0 busy until 3.0


def test_a_free_link_starts_now_and_each_end_hears_when_it_ends():
    fabric = _fabric()
    producer = fabric.worker(KVTransferConfig(SIM_CONNECTOR_NAME, "kv_producer"), 16, "p0")
    consumer = fabric.worker(KVTransferConfig(SIM_CONNECTOR_NAME, "kv_consumer"), 16, "d0")
    assert _load(fabric, "p0", "d0", "a", 100) == pytest.approx(1.0)
    fabric.clock.set(5.0)  # the link has been free since 1.0
    assert _load(fabric, "p0", "d0", "b", 100) == pytest.approx(6.0)
    assert fabric.next_event_s() == pytest.approx(1.0)
    out = consumer.get_finished()  # delivers what ended by 5.0: only "a"
    assert (out.finished_recving, producer.get_finished().finished_sending) == ({"a"}, {"p0-a"})
    assert fabric.next_event_s() == pytest.approx(6.0)
    fabric.clock.set(6.0)
    assert consumer.get_finished().finished_recving == {"b"}
    assert producer.get_finished().finished_sending == {"p0-b"}
    assert fabric.next_event_s() is None
