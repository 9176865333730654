"""The two-micro-batch schedule (``widellm/sim/dbo_pipeline.py``): its docstring's example by
hand, the ideal overlap when one resource is saturated, and the bubble when the chain is
latency-bound."""

import pytest

from widellm.sim.dbo_pipeline import two_batch_pipeline


def test_the_docstring_example():
    one = two_batch_pipeline(2, 1, 2, 1, num_layers=1)
    assert (one.total_s, one.compute_s, one.comm_s) == (9, 8, 4)
    assert one.exposed_comm_s == 1  # the last combine drains
    assert two_batch_pipeline(2, 1, 2, 1, num_layers=2).total_s == 17


def test_compute_bound_layers_hide_all_but_the_drain():
    # Communication much shorter than compute: every layer costs its compute, plus one
    # combine at the end.
    t = two_batch_pipeline(5, 1, 5, 1, num_layers=10)
    assert t.total_s == pytest.approx(10 * 2 * (5 + 5) + 1)


def test_communication_bound_layers_cost_their_communication():
    # Compute 1+1 per micro-batch, communication 5+5: the comm resource runs back to back
    # after the first pre.
    t = two_batch_pipeline(1, 5, 1, 5, num_layers=10)
    assert t.total_s == pytest.approx(1 + 10 * 2 * (5 + 5))
    assert t.exposed_comm_s == pytest.approx(t.total_s - 10 * 2 * 2)


def test_equal_stages_reach_the_ideal_overlap():
    # pre = dispatch = experts = combine = 1: 4 per layer on each resource, and the schedule
    # keeps both busy (by hand: layer 1 ends at 5, each later layer 4 later).
    t = two_batch_pipeline(1, 1, 1, 1, num_layers=20)
    assert t.total_s == 4 * 20 + 1


def test_latency_bound_chain_exceeds_the_ideal_overlap():
    # pre 2, dispatch 1, experts 0, combine 1: 4 per layer on each resource, but combine0 waits
    # behind dispatch1, which waits for pre1. By hand:
    #   layer 1: pre0 [0,2] pre1 [2,4] | dispatch0 [2,3] dispatch1 [4,5] | experts at 4 and 5
    #            | combine0 [5,6] combine1 [6,7]                        -> 7
    #   layer 2: pre0 [6,8] pre1 [8,10] | dispatch0 [8,9] dispatch1 [10,11]
    #            | combine0 [11,12] combine1 [12,13]                    -> 13
    # and 6 per layer from then on, against the ideal 4.
    assert [two_batch_pipeline(2, 1, 0, 1, n).total_s for n in (1, 2, 3, 10)] == [7, 13, 19, 61]


def test_zero_layers_and_negative_stage():
    assert two_batch_pipeline(1, 1, 1, 1, num_layers=0).total_s == 0
    with pytest.raises(ValueError, match="dispatch"):
        two_batch_pipeline(1, -1, 1, 1, num_layers=1)
