"""Simulated expert routing: the sampler's invariants, Zipf and recorded tables."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from widellm.eplb.load_file import ROUTING_COUNTS_FORMAT
from widellm.sim.routing import ExpertRouting, cap_inclusion

# DeepSeek-V3's routing, at the issue's scale: 144 ranks x 256 decode tokens.
V3_EXPERTS, V3_TOP_K = 256, 8
WIDE_RANKS, TOKENS_PER_RANK = 144, 256


def _rows_distinct(ids: np.ndarray) -> bool:
    ordered = np.sort(ids, axis=1)
    return bool((np.diff(ordered, axis=1) > 0).all())


@pytest.mark.parametrize("routing", [
    ExpertRouting.uniform(V3_EXPERTS, V3_TOP_K),
    ExpertRouting.zipf(1.2, V3_EXPERTS, V3_TOP_K, num_layers=3),
    ExpertRouting.zipf(3.0, 16, 4),  # so skewed that the hottest experts are capped
], ids=["uniform", "zipf1.2", "zipf3-capped"])
def test_counts_sum_to_tokens_times_top_k_and_tokens_pick_distinct_experts(routing):
    rng = np.random.default_rng(0)
    tokens = np.array([0, 1, 7, 256, 33])
    counts = routing.counts(tokens, rng)
    assert counts.shape == (5, routing.num_experts) and counts.dtype == np.int64
    assert counts.sum(axis=1).tolist() == (tokens * routing.top_k).tolist()
    ids = routing.sample_experts(5000, rng)
    assert ids.shape == (5000, routing.top_k)
    assert ids.min() >= 0 and ids.max() < routing.num_experts
    assert _rows_distinct(ids)


def test_cap_inclusion_spreads_the_excess():
    q = cap_inclusion(np.array([100.0, 1.0, 1.0, 1.0]), top_k=2)
    assert q == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3])
    assert cap_inclusion(np.array([5.0, 5.0, 0.0]), top_k=2) == pytest.approx([1, 1, 0])
    with pytest.raises(ValueError, match="distinct"):
        cap_inclusion(np.array([1.0, 0.0, 0.0]), top_k=2)


def test_zipf_zero_is_uniform():
    zipf = ExpertRouting.zipf(0.0, 64, 6, num_layers=2)
    assert zipf.inclusion == pytest.approx(np.full((2, 64), 6 / 64))
    # ... and in expectation: 20,000 tokens give each expert 1,875 picks (std ~42).
    counts = zipf.counts(np.array([10_000, 10_000]), np.random.default_rng(1)).sum(axis=0)
    assert np.abs(counts - 20_000 * 6 / 64).max() < 250


def test_zipf_shares_follow_the_rank_power_and_differ_per_layer():
    s, experts, top_k = 1.2, 64, 2
    zipf = ExpertRouting.zipf(s, experts, top_k, num_layers=4, seed=9)
    for layer in zipf.inclusion:
        assert layer.sum() == pytest.approx(top_k) and layer.max() <= 1.0
        ordered = np.sort(layer)[::-1]
        expected = (np.arange(experts) + 1.0) ** -s
        assert ordered == pytest.approx(top_k * expected / expected.sum())
    assert len({int(np.argmax(layer)) for layer in zipf.inclusion}) > 1


def test_sampled_pick_rates_match_the_inclusion_table():
    routing = ExpertRouting.zipf(1.2, 16, 4, num_layers=2, seed=3)
    tokens = 40_000
    for layer in range(2):
        ids = routing.sample_experts(tokens, np.random.default_rng(layer), layer=layer)
        rate = np.bincount(ids.ravel(), minlength=16) / tokens
        q = routing.inclusion[layer]
        std = np.sqrt(q * (1 - q) / tokens)
        assert (np.abs(rate - q) <= 5 * std + 1e-9).all()


def _write_recorded(path, counts):
    path.write_text(json.dumps({"format": ROUTING_COUNTS_FORMAT, "num_experts": len(counts[0]),
                                "top_k": 2, "counts": counts}))
    return str(path)


def test_recorded_counts_reproduce_the_file_proportions(tmp_path):
    counts = [[40, 30, 10, 10, 5, 5, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]
    path = _write_recorded(tmp_path / "routing.json", counts)
    routing = ExpertRouting.from_spec(f"recorded:{path}", 8, 2, num_layers=3)
    assert routing.num_layers == 3 and routing.spec == f"recorded:{path}"
    assert routing.inclusion[2] == pytest.approx(routing.inclusion[0])  # layers repeat
    tokens = np.full(4, 10_000)
    for layer, row in enumerate(counts):
        drawn = routing.counts(tokens, np.random.default_rng(layer), layer=layer).sum(axis=0)
        share = np.array(row) / sum(row)
        assert drawn / drawn.sum() == pytest.approx(share, abs=0.005)
    assert routing.counts(tokens, np.random.default_rng(0), layer=0)[:, 6:].sum() == 0


def test_recorded_torch_file_and_bare_lists(tmp_path):
    counts = [[3, 1, 0, 4]]
    torch.save({"counts": torch.tensor(counts)}, tmp_path / "r.pt")
    (tmp_path / "bare.json").write_text(json.dumps(counts))
    a = ExpertRouting.recorded(str(tmp_path / "r.pt"), 4, 1)
    b = ExpertRouting.recorded(str(tmp_path / "bare.json"), 4, 1)
    assert a.inclusion == pytest.approx(np.array([[3 / 8, 1 / 8, 0, 4 / 8]]))
    assert b.inclusion == pytest.approx(a.inclusion)


def test_recorded_file_must_match_the_model(tmp_path):
    path = _write_recorded(tmp_path / "routing.json", [[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="4 experts recorded, the model has 8"):
        ExpertRouting.recorded(path, 8, 2)


@pytest.mark.parametrize("spec", ["zipf", "zipf:x", "recorded:/no/such/file", "hot", "uniform:2",
                                  "zipf:-1"])
def test_bad_specs_are_refused(spec):
    with pytest.raises(ValueError):
        ExpertRouting.from_spec(spec, 16, 4)


def test_same_rng_same_counts():
    routing = ExpertRouting.zipf(1.0, 32, 4)
    tokens = np.array([50, 60])
    a = routing.counts(tokens, np.random.default_rng(7))
    b = routing.counts(tokens, np.random.default_rng(7))
    assert np.array_equal(a, b)


def test_wide_deployment_step_is_fast():
    # One decode step of a 144-rank deployment: 36,864 tokens x top-8. Measured ~10 ms; the
    # bound is loose so a loaded CI box cannot fail it, tight enough to catch a per-token loop.
    routing = ExpertRouting.zipf(1.2, V3_EXPERTS, V3_TOP_K, num_layers=58)
    tokens = np.full(WIDE_RANKS, TOKENS_PER_RANK)
    rng = np.random.default_rng(0)
    routing.counts(tokens, rng)
    start = time.perf_counter()
    counts = routing.counts(tokens, rng, layer=5)
    assert time.perf_counter() - start < 1.0
    assert counts.sum() == WIDE_RANKS * TOKENS_PER_RANK * V3_TOP_K


def test_recorded_from_a_real_run_replays_its_counts(tmp_path):
    """benchmarks/record_routing.py on the tiny preset, then ``recorded:FILE`` on its file."""
    import importlib.util
    import pathlib
    from argparse import Namespace

    script = pathlib.Path(__file__).parents[2] / "benchmarks" / "record_routing.py"
    spec = importlib.util.spec_from_file_location("record_routing", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prompts, prompt_len, max_tokens = 2, 16, 4
    recorded = module.record(Namespace(model="preset:deepseek-v3-tiny", num_prompts=prompts,
                                       prompt_len=prompt_len, max_tokens=max_tokens, seed=0))
    # deepseek-v3-tiny: 2 MoE layers of 16 experts, top-4. Every prompt token and every decode
    # input (the outputs but the last) passes each MoE layer once; padding rows are skipped.
    tokens = prompts * (prompt_len + max_tokens - 1)
    assert (recorded["num_experts"], recorded["top_k"]) == (16, 4)
    assert recorded["num_tokens"] == [tokens, tokens]
    assert [sum(row) for row in recorded["counts"]] == [tokens * 4, tokens * 4]
    path = tmp_path / "routing.json"
    path.write_text(json.dumps(recorded))
    routing = ExpertRouting.from_spec(f"recorded:{path}", 16, 4, num_layers=2)
    for layer, row in enumerate(recorded["counts"]):
        assert routing.inclusion[layer] == pytest.approx(4 * np.array(row) / sum(row))
