"""Simulated workloads: lengths, arrivals, prefix groups, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from widellm.core.block_hash import chain_block_hashes
from widellm.sim.workload import LengthSpec, SimRequest, WorkloadSpec, generate_requests

VOCAB = 1 << 20  # large, so two random ids collide with probability ~1e-6


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("text, expected", [
    ("2000", LengthSpec("fixed", 2000)),
    ("fixed:7", LengthSpec("fixed", 7)),
    ("uniform:10-30", LengthSpec("uniform", 10, 30)),
    ("normal:2000,200", LengthSpec("normal", 2000, 200)),
    ("lognormal:2000,0.5", LengthSpec("lognormal", 2000, 0.5)),
])
def test_length_spec_parses_and_prints_back(text, expected):
    spec = LengthSpec.parse(text)
    assert spec == expected
    assert LengthSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("text", ["", "fixed:0", "uniform:30-10", "uniform:5", "normal:100",
                                  "poisson:3", "fixed:1.5", "normal:0,1"])
def test_bad_length_specs_are_refused(text):
    with pytest.raises(ValueError):
        LengthSpec.parse(text)


def test_fixed_lengths_are_exact():
    spec = WorkloadSpec(num_requests=20, input_len="fixed:100", output_len=7)
    requests = generate_requests(spec, VOCAB)
    assert [r.request_id for r in requests] == [str(i) for i in range(20)]
    assert all(r.num_prompt_tokens == 100 and r.max_tokens == 7 for r in requests)
    assert all(len(r.prompt_token_ids) == 100 for r in requests)
    assert all(0 <= t < VOCAB for r in requests for t in r.prompt_token_ids)


def test_uniform_lengths_cover_both_ends_and_nothing_else():
    spec = WorkloadSpec(num_requests=300, input_len="uniform:5-7", output_len="uniform:1-2")
    requests = generate_requests(spec, VOCAB)
    assert {r.num_prompt_tokens for r in requests} == {5, 6, 7}
    assert {r.max_tokens for r in requests} == {1, 2}


@pytest.mark.parametrize("text, mean", [("normal:2000,200", 2000), ("lognormal:2000,0.5", 2000)])
def test_distribution_means(text, mean):
    # 20,000 draws: the sample mean's std is 200/141 = 1.4 (normal) and 2000*0.53/141 = 7.5
    # (lognormal); 40 tokens is > 5 of either.
    lengths = LengthSpec.parse(text).sample(20_000, np.random.default_rng(0))
    assert lengths.dtype == np.int64 and lengths.min() >= 1
    assert abs(lengths.mean() - mean) < 40


def test_prefix_groups_share_exactly_prefix_len_ids():
    spec = WorkloadSpec(num_requests=9, input_len=50, output_len=4, num_prefix_groups=3,
                        prefix_len=32, seed=5)
    requests = generate_requests(spec, VOCAB)
    prompts = [r.prompt_token_ids for r in requests]
    for i in range(9):
        for j in range(i + 1, 9):
            shared = _common_prefix(prompts[i], prompts[j])
            assert shared == (32 if i % 3 == j % 3 else 0), (i, j)
    # One prefix object per group, not a copy per request.
    assert requests[0].prefix is requests[3].prefix is requests[6].prefix
    assert [r.prefix_group for r in requests] == [0, 1, 2] * 3


def test_prefix_groups_hit_the_prefix_cache_keys():
    spec = WorkloadSpec(num_requests=4, input_len=64, output_len=1, num_prefix_groups=2,
                        prefix_len=40)
    a, b, c, _ = generate_requests(spec, VOCAB)
    block = 16
    ha, hb, hc = (chain_block_hashes(r.prompt_token_ids, block) for r in (a, b, c))
    # 40 shared tokens = 2 full shared blocks; the third block mixes in each prompt's own ids.
    assert ha[:2] == hc[:2] and ha[2] != hc[2]
    assert not set(ha) & set(hb)


def test_every_prompt_keeps_its_own_token_past_the_prefix():
    spec = WorkloadSpec(num_requests=50, input_len="normal:10,5", output_len=1,
                        num_prefix_groups=1, prefix_len=12)
    assert min(r.num_prompt_tokens for r in generate_requests(spec, VOCAB)) == 13
    with pytest.raises(ValueError, match="exceed prefix_len"):
        WorkloadSpec(num_requests=1, input_len=12, num_prefix_groups=1, prefix_len=12)


def test_same_seed_same_requests_other_seed_other_requests():
    spec = WorkloadSpec(num_requests=30, input_len="uniform:10-40", output_len="uniform:1-9",
                        request_rate=5.0, seed=3)
    one, two = generate_requests(spec, VOCAB), generate_requests(spec, VOCAB)
    assert one == two
    assert [r.prompt_token_ids for r in one] == [r.prompt_token_ids for r in two]
    other = generate_requests(WorkloadSpec(**{**spec.to_dict(), "seed": 4}), VOCAB)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in one]
    assert [r.arrival_s for r in other] != [r.arrival_s for r in one]


def test_poisson_arrivals_have_the_rate():
    n, rate = 20_001, 10.0
    arrivals = [r.arrival_s for r in generate_requests(
        WorkloadSpec(num_requests=n, input_len=1, output_len=1, request_rate=rate), VOCAB)]
    assert arrivals[0] == 0.0 and all(b >= a for a, b in zip(arrivals, arrivals[1:]))
    # Mean gap over 20,000 exponential gaps: std 0.1 / 141 = 0.0007; 3% (0.003) is > 4 std.
    assert arrivals[-1] / (n - 1) == pytest.approx(1 / rate, rel=0.03)
    gaps = np.diff(arrivals)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


def test_burstiness_changes_the_spread_not_the_rate():
    spec = WorkloadSpec(num_requests=20_001, input_len=1, output_len=1, request_rate=10.0,
                        burstiness=0.25)
    gaps = np.diff([r.arrival_s for r in generate_requests(spec, VOCAB)])
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)  # gamma: CV 1/sqrt(k)


def test_closed_loop_and_burst_arrivals():
    closed = generate_requests(WorkloadSpec(num_requests=3, input_len=4, output_len=1,
                                            concurrency_per_rank=2), VOCAB)
    assert [r.arrival_s for r in closed] == [None] * 3
    at_once = generate_requests(WorkloadSpec(num_requests=3, input_len=4, output_len=1), VOCAB)
    assert [r.arrival_s for r in at_once] == [0.0] * 3
    infinite = generate_requests(WorkloadSpec(num_requests=3, input_len=4, output_len=1,
                                              request_rate=float("inf")), VOCAB)
    assert [r.arrival_s for r in infinite] == [0.0] * 3


@pytest.mark.parametrize("kwargs", [
    {"request_rate": 1.0, "concurrency_per_rank": 2},
    {"request_rate": 0.0},
    {"concurrency_per_rank": 0},
    {"prefix_len": 8},
    {"num_prefix_groups": 2},
    {"burstiness": 0.0},
    {"num_requests": -1},
])
def test_bad_workloads_are_refused(kwargs):
    with pytest.raises(ValueError):
        WorkloadSpec(**{"num_requests": 1, "input_len": 100, **kwargs})


def test_request_holds_no_token_list():
    (request,) = generate_requests(WorkloadSpec(num_requests=1, input_len=2000), VOCAB)
    assert isinstance(request, SimRequest)
    assert not any(isinstance(v, list) for v in vars(request).values())
    ids = request.prompt_token_ids
    assert type(ids) is list and all(type(t) is int for t in ids[:10])
    assert request.prompt_array().tolist() == ids
