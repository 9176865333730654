"""The producer's lease table, driven by a fake clock."""

import pytest

from widellm.kv_transfer.holds import HoldTable

LEASE_S = 10.0


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock) -> HoldTable:
    return HoldTable(LEASE_S, clock=clock)


def test_a_completed_send_ends_the_hold(table):
    table.add("r", [3, 5, 6])
    assert table.counts() == (1, 3)
    assert table.begin_send("r", [3, 5]) is None
    assert table.collect_ended() == set()  # still sending
    assert not table.progress.is_set()
    table.end_send("r")
    assert table.progress.is_set()
    assert table.counts() == (0, 0)
    assert table.collect_ended() == {"r"}
    assert not table.progress.is_set()
    assert table.collect_ended() == set()  # handed over once, then forgotten
    assert table.leases_expired == 0
    # Forgotten: a second pull of it is refused.
    assert table.begin_send("r", [3]) == "unknown_request"


def test_begin_send_refusals(table):
    table.add("r", [3, 5])
    assert table.begin_send("nope", [3]) == "unknown_request"
    assert table.begin_send("r", [3, 4]) == "layout"
    assert table.begin_send("r", [7]) == "layout"
    # A refusal claims nothing: the hold ends on release at once.
    table.release(["r"])
    assert table.collect_ended() == {"r"}
    # Ended but not collected yet counts as unknown too.
    table.add("s", [1])
    table.release(["s"])
    assert table.begin_send("s", [1]) == "unknown_request"


def test_heartbeat_extends_the_lease_exactly(table, clock):
    table.add("r", [1, 2])
    assert table.next_expiry_in() == pytest.approx(LEASE_S)
    clock.now += 6.0
    assert table.next_expiry_in() == pytest.approx(4.0)
    assert table.heartbeat(["r", "ghost"]) == ["ghost"]
    # Expires exactly one lease after the heartbeat.
    assert table.next_expiry_in() == pytest.approx(LEASE_S)
    clock.now += LEASE_S - 0.001
    assert table.collect_ended() == set()
    clock.now += 0.001
    assert table.collect_ended() == {"r"}
    assert table.leases_expired == 1
    assert table.heartbeat(["r"]) == ["r"]  # gone now
    assert table.next_expiry_in() is None


def test_heartbeat_never_shortens_a_lease(clock):
    table = HoldTable(LEASE_S, clock=clock)
    table.add("r", [1])
    table.lease_s = 1.0  # a shorter lease now: the old expiry stands
    assert table.heartbeat(["r"]) == []
    assert table.next_expiry_in() == pytest.approx(LEASE_S)


def test_release_while_sending_waits_for_end_send(table):
    table.add("r", [4])
    assert table.begin_send("r", [4]) is None
    table.release(["r"])
    assert table.counts() == (1, 1)
    assert table.collect_ended() == set()
    table.end_send("r")
    assert table.collect_ended() == {"r"}
    assert table.leases_expired == 0


def test_release_of_unknown_ids_is_ignored(table):
    table.release(["ghost"])
    assert table.collect_ended() == set()


def test_a_lease_does_not_expire_while_a_send_is_in_progress(table, clock):
    table.add("r", [1])
    table.add("s", [2, 3])
    table.add("t", [4])
    assert table.begin_send("r", [1]) is None
    clock.now += 5.0
    assert table.heartbeat(["t"]) == []  # t now expires at 115
    clock.now += LEASE_S  # 115: r and s are past expiry, t exactly at it
    assert table.collect_ended() == {"s", "t"}
    assert table.leases_expired == 2
    assert table.counts() == (1, 1)
    # r's expiry is in the past: next_expiry_in clamps to 0.
    assert table.next_expiry_in() == 0.0
    table.end_send("r")
    assert table.collect_ended() == {"r"}
    assert table.leases_expired == 2  # ended by its send, not by its lease


def test_counts_and_next_expiry(table, clock):
    assert table.counts() == (0, 0)
    assert table.next_expiry_in() is None
    table.add("a", [1, 2, 3])
    clock.now += 2.0
    table.add("b", [7])
    assert table.counts() == (2, 4)
    assert table.next_expiry_in() == pytest.approx(LEASE_S - 2.0)
    table.release(["a"])
    assert table.counts() == (1, 1)  # ended holds no longer count, even before collection
    assert table.next_expiry_in() == pytest.approx(LEASE_S)


def test_two_sends_end_the_hold_at_the_last(table):
    table.add("r", [1, 2])
    assert table.begin_send("r", [1]) is None
    assert table.begin_send("r", [2]) is None
    table.end_send("r")
    assert table.collect_ended() == set()
    table.end_send("r")
    assert table.collect_ended() == {"r"}


# ---- running holds (streamed prompts) ------------------------------------------------------

def test_a_running_hold_outlives_its_pull_and_ends_when_the_prompt_finishes(table, clock):
    table.add_running("r", [3])
    table.add_running("r", [5])  # the next chunk's block
    assert table.block_ids("r") == [3, 5]
    assert table.begin_send("r", None) is None
    table.end_send("r")
    clock.now += 10 * LEASE_S  # no lease runs while the prompt runs
    assert table.collect_ended() == set()
    assert table.counts() == (1, 2)
    table.add("r", [3, 5, 6])  # finished; its pull already completed: ends at once
    assert table.collect_ended() == {"r"}
    assert table.counts() == (0, 0)


def test_a_running_hold_becomes_a_leased_hold(table, clock):
    table.add_running("r", [3])
    table.add("r", [3, 4])
    assert table.block_ids("r") == [3, 4]
    clock.now += LEASE_S
    assert table.collect_ended() == {"r"}
    assert table.leases_expired == 1


def test_a_released_running_hold_ends_when_the_prompt_finishes(table):
    table.add_running("r", [3])
    table.release(["r"])
    assert table.collect_ended() == set()
    table.add("r", [3])
    assert table.collect_ended() == {"r"}


def test_cancel_ends_a_running_hold_after_its_send(table):
    table.add_running("r", [3])
    assert table.begin_send("r", None) is None
    table.cancel("r")
    assert table.collect_ended() == set()  # the send still reads
    table.end_send("r")
    assert table.collect_ended() == {"r"}
    assert not table.is_live("r")


def test_a_hold_made_anew_before_the_old_one_is_collected_survives(table):
    table.add_running("r", [3])
    table.cancel("r")  # preempted ...
    table.add_running("r", [7])  # ... and scheduled again
    assert table.collect_ended() == {"r"}
    assert table.block_ids("r") == [7]
