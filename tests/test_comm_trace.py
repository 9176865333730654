"""The MoE exchange trace: a tracked transfer's log entry, the split of exposed time into
waiting for peers and transfer (the docstring's hand-checked example), and on two gloo ranks
a rank that launches late shows up as the other's wait for a peer."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_ranks
from tests.layers.test_comm_tracking import _clock, _ScriptedWork
from widellm.comm_trace import COMM_TRACE_DIR_ENV, Exchange, ExchangeLog, load, split_exposed
from widellm.engine.arg_utils import EngineArgs
from widellm.layers.moe.comm_tracking import TrackedWork
from widellm.step_timer import StepTimer

RUN_TIMEOUT_S = 60.0
LATE_S = 0.3  # how much later rank 1 launches its side
NUM_TRANSFERS = 3


def test_the_docstring_example():
    rank0 = [Exchange(0, 1.0, 3.9, 1.5, 4.0, False, 8)]
    rank1 = [Exchange(0, 3.0, 3.9, 3.5, 4.0, False, 8)]
    got = split_exposed([rank0, rank1])
    assert got[0] == pytest.approx({
        "exposed_s": 2.5, "exposed_waiting_for_peers_s": 1.5, "exposed_transfer_s": 1.0,
        "hidden_s": 0.5, "transfer_s": 0.9, "exchanges": 1})
    assert got[1] == pytest.approx({
        "exposed_s": 0.5, "exposed_waiting_for_peers_s": 0.0, "exposed_transfer_s": 0.5,
        "hidden_s": 0.5, "transfer_s": 0.9, "exchanges": 1})


def test_idle_transfers_set_the_start_but_count_for_nobody():
    # Rank 1 ran a dummy batch: its launch at 3.0 still delays rank 0's transfer.
    rank0 = [Exchange(0, 1.0, None, 1.0, 4.0, False, 8)]
    rank1 = [Exchange(0, 3.0, None, 3.0, 4.0, True, 8)]
    got = split_exposed([rank0, rank1])
    assert got[0]["exposed_waiting_for_peers_s"] == 2.0
    assert got[0]["transfer_s"] == 1.0  # no completion time: until the wait ended
    assert got[1]["exchanges"] == 0 and got[1]["exposed_s"] == 0.0


def test_a_token_bound_keeps_the_small_forwards():
    # A prompt forward (4,096 rows) where rank 1 lags by 1.0, then a decode one (32 rows).
    decode_step = Exchange(1, 3.0, 3.5, 3.0, 3.5, False, 32)
    rank0 = [Exchange(0, 1.0, 2.5, 1.0, 2.5, False, 4096), decode_step]
    rank1 = [Exchange(0, 2.0, 2.5, 2.0, 2.5, False, 4096), decode_step]
    everything, decode = split_exposed([rank0, rank1]), split_exposed([rank0, rank1], 256)
    assert everything[0]["exposed_waiting_for_peers_s"] == 1.0
    assert decode[0] == pytest.approx({
        "exposed_s": 0.5, "exposed_waiting_for_peers_s": 0.0, "exposed_transfer_s": 0.5,
        "hidden_s": 0.0, "transfer_s": 0.5, "exchanges": 1})


def test_logs_of_different_runs_are_refused():
    one = [Exchange(0, 1.0, 2.0, 1.0, 2.0, False, 8)]
    two = one + [Exchange(1, 3.0, 4.0, 3.0, 4.0, False, 8)]
    with pytest.raises(ValueError, match="rank 1 logged 2 exchanges, rank 0 1"):
        split_exposed([one, two])


def test_a_tracked_transfer_is_logged_in_launch_order(monkeypatch, tmp_path):
    # Launches at 1.0 and 2.0 (the second by a dummy batch); the second is waited on first
    # (3.0 -> 4.0, completing at 3.5), then the first (4.25 -> 5.0, completing at 4.5).
    _clock(monkeypatch, [1.0, 2.0, 3.0, 3.5, 4.0, 4.25, 4.5, 5.0])
    log = ExchangeLog()
    timer = StepTimer(exchange_log=log)
    first = TrackedWork(_ScriptedWork(complete_in_wait=True), timer)
    second = TrackedWork(_ScriptedWork(complete_in_wait=True), timer.for_idle())
    second.wait()
    first.wait()
    assert log.records == [Exchange(1, 2.0, 3.5, 3.0, 4.0, True, -1),
                           Exchange(0, 1.0, 4.5, 4.25, 5.0, False, -1)]
    log.dump(tmp_path / "rank0.json")
    assert load(tmp_path) == [sorted(log.records, key=lambda e: e.seq)]
    # The idle view's phases go nowhere; without a log a dummy batch carries no timer.
    assert timer.totals == {"comm_exposed": 0.75, "comm_window": 3.25}
    assert StepTimer().for_idle() is None


def _rank_late_launch(rank: int, world_size: int) -> list[Exchange]:
    log = ExchangeLog()
    timer = StepTimer(exchange_log=log)
    for _ in range(NUM_TRANSFERS):
        dist.barrier()
        if rank == 1:
            time.sleep(LATE_S)
        send = torch.full((world_size * 4,), float(rank))
        recv = torch.empty_like(send)
        TrackedWork(dist.all_to_all_single(recv, send, async_op=True), timer).wait()
        assert recv.tolist() == [0.0] * 4 + [1.0] * 4
    return log.records


def test_a_late_rank_is_the_other_ranks_wait_for_a_peer():
    logs = run_ranks(_rank_late_launch, 2, timeout_s=RUN_TIMEOUT_S)
    assert [[e.seq for e in log] for log in logs] == [list(range(NUM_TRANSFERS))] * 2
    early, late = split_exposed(logs)
    assert early["exchanges"] == late["exchanges"] == NUM_TRANSFERS
    # Rank 0 waited at least the sleep for rank 1 each time; rank 1 never waited for rank 0
    # (rank 0 had launched before rank 1 woke up).
    assert early["exposed_waiting_for_peers_s"] >= NUM_TRANSFERS * LATE_S * 0.9
    assert late["exposed_waiting_for_peers_s"] == 0.0
    # Of rank 0's exposed time, what was not waiting for rank 1 is the transfer itself.
    assert early["exposed_s"] == pytest.approx(
        early["exposed_waiting_for_peers_s"] + early["exposed_transfer_s"])


def test_a_trace_directory_without_the_step_breakdown_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(COMM_TRACE_DIR_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="add --collect-step-breakdown"):
        EngineArgs(model="preset:llama-tiny").create_engine_config()
