"""Sampled ids handed to the host behind the next step (``worker/sampled_ids.py``): the
placeholders, the device feed and the settle by hand, and an engine deferring them (the CPU
flag ``WIDELLM_TEST_DEFER_SAMPLED_IDS``, what a CUDA engine with async scheduling does) giving
the immediate engine's tokens, with preemption, stop rules, penalties, n > 1, logprobs rows and
graph steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from widellm import LLM, SamplingParams
from widellm.core.outputs import ModelRunnerOutput
from widellm.ops.cpu_kernels import load_cpu_kernels
from widellm.worker.input_batch import BatchInputs, CachedRequestState
from widellm.worker.model_runner import TEST_DEFER_SAMPLED_IDS_ENV, TEST_EAGER_GRAPHS_ENV
from widellm.worker.sampled_ids import (
    PLACEHOLDER_TOKEN_ID, DeviceSampledIds, SampledIdsHandoff,
)


def _state(req_id: str, tokens: list[int], prompt_len: int) -> CachedRequestState:
    return CachedRequestState(req_id, list(tokens), prompt_len, SamplingParams(), frozenset(),
                              [0], len(tokens))


def test_placeholders_feed_and_settle_by_hand():
    states = {"a": _state("a", [5, 6, 7], 2), "b": _state("b", [8, 9], 2),
              "c": _state("c", [1, 2, 3, 4], 4)}
    handoff = SampledIdsHandoff(enabled=True)
    sampled = DeviceSampledIds(torch.tensor([70, 90]), {"b": 0, "a": 1})
    handoff.defer(sampled, states, ["b", "a"])
    assert states["a"].token_ids == [5, 6, 7, PLACEHOLDER_TOKEN_ID]
    assert states["b"].token_ids == [8, 9, PLACEHOLDER_TOKEN_ID]
    with pytest.raises(RuntimeError, match="settle"):
        handoff.defer(sampled, states, ["a"])
    # Next step: a and b decode one row each (their placeholder), c runs a 2-token chunk;
    # padding row after them.
    batch = BatchInputs(req_ids=["a", "b", "c"],
                        input_ids=torch.tensor([-1, -1, 3, 4]),
                        positions=np.array([3, 2, 2, 3]), query_lens=np.array([1, 1, 2]),
                        context_lens=np.array([4, 3, 4]), block_table=np.zeros((3, 1)))
    ids = torch.cat([batch.input_ids, torch.zeros(1, dtype=torch.int64)])
    assert handoff.feed(batch, ids, states).tolist() == [90, 70, 3, 4, 0]
    # A request whose state was replaced since (preempted and resumed) is not fed.
    states["a"] = _state("a", [5, 6, 7, 11], 2)
    assert handoff.feed(batch, torch.tensor([-1, -1, 3, 4]), states).tolist() == [-1, 70, 3, 4]
    old_a = handoff._held["a"].state
    handoff.settle()
    assert states["b"].token_ids == [8, 9, 70] and old_a.token_ids == [5, 6, 7, 90]
    assert handoff.pending is None
    handoff.settle()  # nothing held: a no-op


def test_runner_output_resolves_its_pending_rows_once():
    calls = []

    def pending():
        calls.append(1)
        return [7, 8]

    out = ModelRunnerOutput(["x", "y", "z"], {"x": 0, "y": 1, "z": 2}, [[], [], []],
                            pending=pending, pending_rows=[(2, 0), (0, 1)])
    assert out.resolve().sampled_token_ids == [[8], [], [7]]
    out.resolve()
    assert len(calls) == 1


POOL_BLOCKS = 24  # forces preemption for the 300-token prompt next to the others
PROMPT_LENS = (5, 17, 33, 64, 100, 300)
MAX_TOKENS = (32, 5, 40, 1, 20, 32)


def _run(path: str, monkeypatch, defer: bool, graphs: bool = False):
    monkeypatch.setenv(TEST_DEFER_SAMPLED_IDS_ENV, "1" if defer else "0")
    monkeypatch.setenv(TEST_EAGER_GRAPHS_ENV, "1" if graphs else "0")
    with LLM(path, dtype="float32", num_kv_blocks=POOL_BLOCKS,
             max_model_len=POOL_BLOCKS * 16, async_scheduling=True,
             cuda_graph_sizes="1,2,4,8" if graphs else None) as llm:
        runner = llm.llm_engine.engine_core.model_runner
        deferred = []
        real_defer = runner.handoff.defer

        def counting(sampled, states, req_ids):
            deferred.append(len(req_ids))
            real_defer(sampled, states, req_ids)

        runner.handoff.defer = counting
        vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
        params = [SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, max_tokens=m,
                                 ignore_eos=i != 4, repetition_penalty=1.3 if i == 2 else 1.0,
                                 n=2 if i == 3 else 1, logprobs=1 if i == 1 else None)
                  for i, m in enumerate(MAX_TOKENS)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        core = llm.llm_engine.engine_core
        assert core.scheduler.num_preemptions > 0
        result = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
        lp = [lp_[t].logprob for t, lp_ in zip(outs[1].outputs[0].token_ids,
                                                outs[1].outputs[0].logprobs)]
    return result, lp, deferred


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def test_deferred_engine_equals_immediate(model_dir, monkeypatch, arch):
    path = model_dir(arch)
    immediate, lp, none = _run(path, monkeypatch, defer=False)
    deferred, lp_deferred, steps = _run(path, monkeypatch, defer=True)
    assert none == [] and len(steps) > 10  # it did defer (not in the logprobs steps)
    assert deferred == immediate
    assert lp_deferred == pytest.approx(lp, abs=1e-5)


@pytest.mark.skipif(load_cpu_kernels() is None, reason="in-place CPU decode needs the kernels")
def test_deferred_ids_feed_graph_steps(model_dir, monkeypatch):
    path = model_dir("DeepseekV3ForCausalLM")
    immediate, _, _ = _run(path, monkeypatch, defer=False, graphs=True)
    deferred, _, steps = _run(path, monkeypatch, defer=True, graphs=True)
    assert len(steps) > 10 and deferred == immediate


def _sample_step_host_reads(path: str, monkeypatch, defer: bool) -> list[str]:
    """Host reads of tensors inside the runner's sample steps (greedy requests)."""
    from tests.worker.test_decode_graph_capturable import HostSyncRecorder

    monkeypatch.setenv(TEST_DEFER_SAMPLED_IDS_ENV, "1" if defer else "0")
    with LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256,
             async_scheduling=True) as llm:
        runner = llm.llm_engine.engine_core.model_runner
        real, found = runner._sample, []

        def recorded(batch, hidden):
            with HostSyncRecorder() as rec:
                out = real(batch, hidden)
            found.extend(rec.found)
            return out

        runner._sample = recorded
        llm.generate([[5, 6, 7, 8], [9, 10, 11]],
                     SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                     use_tqdm=False)
    return found


def test_a_deferred_sample_step_reads_only_the_previous_steps_copy(model_dir, monkeypatch):
    """What would make a GPU step wait for its own forward: a read of this step's sampled
    ids. With deferral the only host reads are of the previous step's copy (settled after
    this step's forward was queued); without it, the step reads its own ids (the check's
    control)."""
    path = model_dir("DeepseekV3ForCausalLM")
    deferred = _sample_step_host_reads(path, monkeypatch, defer=True)
    # (Empty when the engine core's thread happened to read each copy first.)
    assert all("sampled_ids.py" in f for f in deferred), deferred
    immediate = _sample_step_host_reads(path, monkeypatch, defer=False)
    assert any("model_runner.py" in f and f.startswith("tolist") for f in immediate), immediate
