"""Decode graph steps under expert parallelism, on CPU (gloo): every rank builds the graph
runner's eager twin at start-up (``WIDELLM_TEST_EAGER_GRAPHS``, where a CUDA engine captures
its graphs) and replays decode steps through the persistent step buffers, each rank at its own
capture size while the others replay theirs, run a prompt step or a dummy batch, all through
the same fixed-capacity exchange. Greedy outputs equal one rank's, token for token, with
uneven load, async scheduling (sampled ids reaching the host behind the next step, as on a
GPU) and EPLB moving experts mid-generation; a backend whose
exchange a graph cannot record runs every step eagerly."""

from __future__ import annotations

import pytest

from tests.e2e.test_eplb import (
    INTERVAL, MAX_TOKENS, NUM_KV_BLOCKS, REDUNDANT, WINDOW, _prompts, skewed,  # noqa: F401
)
from tests.e2e.test_wide_ep import PLACEMENT
from widellm import LLM, SamplingParams
from widellm.step_timer import summarize
from widellm.worker.model_runner import TEST_DEFER_SAMPLED_IDS_ENV, TEST_EAGER_GRAPHS_ENV

GRAPH_SIZES = "1,2,4,8"
EPLB = dict(enable_eplb=True, eplb_num_redundant_experts=REDUNDANT, eplb_window_size=WINDOW,
            eplb_step_interval=INTERVAL)


def _generate(path: str, **engine_kwargs):
    """Greedy tokens, each rank's graph replay seconds, and EPLB's rebalance count."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()
    ranks = (PLACEMENT[2] * 2)[:len(prompts)]
    with LLM(path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=8,
             **engine_kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False, data_parallel_rank=ranks)
        client = llm.llm_engine.client
        replays, rebalances = {}, 0
        if client is not None:
            replays = {r: summarize(b)["graph_replay_s"] for r, b in client.last_breakdown.items()}
            rebalances = min((s.num_rebalances for s in client.eplb_stats.values()), default=0)
    return [o.outputs[0].token_ids for o in outs], replays, rebalances


@pytest.mark.parametrize("backend,extra", [
    ("auto", {"async_scheduling": True, **EPLB}),
    ("all2all_fixed", {}),
], ids=["auto-async-eplb", "all2all_fixed"])
def test_graph_steps_under_expert_parallelism_equal_one_rank(skewed, monkeypatch, backend,
                                                             extra):
    path, expected = skewed  # one rank, no graphs
    monkeypatch.setenv(TEST_EAGER_GRAPHS_ENV, "1")
    if extra.get("async_scheduling"):  # as a CUDA engine with async scheduling does
        monkeypatch.setenv(TEST_DEFER_SAMPLED_IDS_ENV, "1")
    got, replays, rebalances = _generate(
        path, data_parallel_size=2, enable_expert_parallel=True, all2all_backend=backend,
        cuda_graph_sizes=GRAPH_SIZES, collect_step_breakdown=True, **extra)
    assert got == expected
    assert sorted(replays) == [0, 1] and all(s > 0 for s in replays.values()), replays
    if extra.get("enable_eplb"):
        assert rebalances >= 1  # experts moved while graph steps replayed


def test_a_backend_graphs_cannot_record_runs_eagerly(skewed, monkeypatch):
    path, expected = skewed
    monkeypatch.setenv(TEST_EAGER_GRAPHS_ENV, "1")
    got, replays, _ = _generate(path, data_parallel_size=2, enable_expert_parallel=True,
                                all2all_backend="all2all", cuda_graph_sizes=GRAPH_SIZES,
                                collect_step_breakdown=True)
    assert got == expected
    assert replays == {0: 0.0, 1: 0.0}
