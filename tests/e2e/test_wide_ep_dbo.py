"""Dual-batch overlap end to end: with every step split into two interleaved micro-batches,
greedy fp32 outputs equal DBO off and one rank, token for token, for every backend at DP2 and
DP4 on tiny DeepSeek-V3 and Qwen3-MoE, under the uneven load of test_wide_ep (one rank with
most requests, one with none at DP4, prompts of 5-300 tokens so ranks go idle at different
steps and run split dummy batches). A small step budget chunks the prompts, so micro-batch
cuts fall inside prompt chunks; the stats prove the steps did split. Qwen3-MoE runs with
async scheduling as well (DBO + async == one rank)."""

from __future__ import annotations

import pytest

from tests.e2e.test_models_vs_hf import MAX_NEW_TOKENS, make_prompts
from tests.e2e.test_wide_ep import (  # noqa: F401 (reference is a fixture)
    BACKENDS, PLACEMENT, generate, is_qwen3_moe, reference,
)
from widellm.comm_trace import COMM_TRACE_DIR_ENV, load, split_exposed
from widellm.engine.llm import LLM
from widellm.sampling_params import SamplingParams

# Thresholds at their minimum, so decode steps of 2+ tokens and every prompt step split.
SPLIT_ALWAYS = dict(enable_dbo=True, dbo_decode_token_threshold=2,
                    dbo_prefill_token_threshold=2)
# Prompt chunks of at most this many tokens: the 300-token prompt spans several steps and
# each step's cut falls inside a chunk.
STEP_BUDGET = 96
# Suite time: the DP4 cases of each model (DeepSeek-V3, Qwen3-MoE); each backend runs at DP4.
DP4_BACKENDS = {False: ("all2all", "all2all_fixed"), True: ("allgather_reducescatter",)}


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dbo_equals_single_rank(reference, backend, dp):
    path, prompts, expected = reference
    if dp == 4 and backend not in DP4_BACKENDS[is_qwen3_moe(path)]:
        pytest.skip("suite time: DP4 runs each backend with one model; all run at DP2")
    # Qwen3-MoE runs with async scheduling too: its async matrix (test_wide_ep) is this one.
    ep = dict(data_parallel_size=dp, enable_expert_parallel=True, all2all_backend=backend,
              max_num_batched_tokens=STEP_BUDGET, async_scheduling=is_qwen3_moe(path))
    # DBO off equals one rank for the same matrix in test_wide_ep.
    assert _generate_counting_splits(path, prompts, PLACEMENT[dp], **ep, **SPLIT_ALWAYS) == expected


def test_dbo_auto_equals_single_rank(reference):
    """auto measures both settings (it alternates per kind of step until it has samples of
    each), so some steps split and some do not; outputs stay those of one rank."""
    path, prompts, expected = reference
    got = _generate_counting_splits(
        path, prompts, PLACEMENT[2], data_parallel_size=2, enable_expert_parallel=True,
        all2all_backend="allgather_reducescatter", max_num_batched_tokens=STEP_BUDGET,
        enable_dbo="auto", dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2,
        expect_all_split=False)
    assert got == expected


@pytest.fixture(scope="module")
def deepseek_reference(model_dir):
    """One model is enough here: the accounting is the backends', not the model's."""
    from transformers import AutoConfig

    path = model_dir("DeepseekV3ForCausalLM")
    prompts = make_prompts(AutoConfig.from_pretrained(path).vocab_size)
    return path, prompts, generate(path, prompts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_breakdown_reports_exposed_and_hidden_communication(deepseek_reference, backend,
                                                                 monkeypatch, tmp_path):
    """Each rank's breakdown with DBO on: transfer time blocked on is part of the MoE exchange
    stages, and some transfer time passed behind the other micro-batch's compute. The ranks'
    exchange traces (widellm/comm_trace.py) line up, rank 1's idle dummy batches included, and
    add up to the breakdown's exposed time."""
    monkeypatch.setenv(COMM_TRACE_DIR_ENV, str(tmp_path))
    path, prompts, expected = deepseek_reference
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    with LLM(path, dtype="float32", num_kv_blocks=256, data_parallel_size=2,
             enable_expert_parallel=True, all2all_backend=backend, collect_step_breakdown=True,
             max_num_batched_tokens=STEP_BUDGET, **SPLIT_ALWAYS) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False, data_parallel_rank=PLACEMENT[2])
        breakdown = summarize_ranks(llm.llm_engine.client.last_breakdown)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sorted(breakdown) == [0, 1]
    for b in breakdown.values():
        assert 0 < b["comm_exposed_s"] <= b["communication_s"], b
        assert b["comm_hidden_s"] > 0, b
    logs = load(tmp_path)
    assert len(logs) == 2 and any(e.idle for e in logs[1])  # rank 1 runs out of work first
    assert all(e.tokens > 0 for log in logs for e in log)
    for rank, split in enumerate(split_exposed(logs)):
        assert split["exposed_s"] == pytest.approx(breakdown[rank]["comm_exposed_s"])
        assert split["hidden_s"] == pytest.approx(breakdown[rank]["comm_hidden_s"])


def summarize_ranks(raw: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    from widellm.step_timer import summarize

    return {rank: summarize(totals) for rank, totals in raw.items()}


def _generate_counting_splits(path, prompts, ranks, expect_all_split=True,
                              **engine_kwargs):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    with LLM(path, dtype="float32", num_kv_blocks=256, **engine_kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False, data_parallel_rank=ranks)
        stats = llm.llm_engine.client.last_stats
    split = {rank: s.num_dbo_steps for rank, s in stats.items()}
    steps = {rank: s.num_steps for rank, s in stats.items()}
    # A step splits only when no rank's batch is below its threshold (one decode request
    # vetoes), so not every step does; every rank with requests saw splits.
    assert all(split[r] > 0 for r in split), (split, steps)
    if not expect_all_split:
        assert all(split[r] < steps[r] for r in split), (split, steps)
    return [o.outputs[0].token_ids for o in outs]
