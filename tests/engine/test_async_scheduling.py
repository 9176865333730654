"""Async scheduling (step N+1 scheduled while step N runs) gives exactly the synchronous
outputs, on a mixed batch with different lengths, stop rules and forced preemption; behind a
step with prompt tokens the next step waits for it, so new arrivals join at once."""

from __future__ import annotations

import pytest
import torch

from widellm import LLM, SamplingParams

POOL_BLOCKS = 24  # forces preemption for the 300-token prompt next to the others
PROMPT_LENS = (5, 17, 33, 64, 100, 150, 250, 300)
MAX_TOKENS = (32, 5, 40, 1, 20, 32, 3, 32)
IGNORE_EOS = (True, False, True, True, False, True, True, False)


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_async_equals_sync(model_dir, arch):
    path = model_dir(arch)
    results, logprobs, preemptions = {}, {}, {}
    for async_scheduling in (False, True):
        llm = LLM(path, dtype="float32", num_kv_blocks=POOL_BLOCKS,
                  max_model_len=POOL_BLOCKS * 16, async_scheduling=async_scheduling)
        vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=e, logprobs=1)
                  for m, e in zip(MAX_TOKENS, IGNORE_EOS)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[async_scheduling] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                                     for o in outs]
        logprobs[async_scheduling] = [
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in outs
        ]
        core = llm.llm_engine.engine_core
        preemptions[async_scheduling] = core.scheduler.num_preemptions
        kv = core.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.block_pool.num_blocks
        assert not core.batch_queue
    assert results[True] == results[False]
    # Batches differ in size between the modes (async also runs a step for requests that
    # turn out finished), so matmul rounding may differ in the last bits, never more.
    for a, b in zip(logprobs[True], logprobs[False]):
        assert a == pytest.approx(b, abs=1e-4)
    assert preemptions[True] > 0 and preemptions[False] > 0
    # Lengths follow max_tokens where EOS is ignored.
    for (ids, reason), m, e in zip(results[True], MAX_TOKENS, IGNORE_EOS):
        if e:
            assert len(ids) == m and reason == "length"


@pytest.mark.timeout(120)
def test_stop_string_abort_while_a_step_is_in_flight(model_dir):
    """A stop string found by the frontend aborts the request while async scheduling already
    has its next step in flight: that step is still collected (the engine neither spins on it
    nor hangs) and the output ends at the stop string."""
    llm = LLM(model_dir("LlamaForCausalLM"), dtype="float32", num_kv_blocks=64,
              max_model_len=256, async_scheduling=True)
    prompt = {"prompt_token_ids": list(range(5, 25))}
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 2:][:3]
    assert stop
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    core = llm.llm_engine.engine_core
    assert not core.batch_queue and not core.has_unfinished_requests()


@pytest.mark.timeout(120)
def test_a_prompt_step_has_no_step_scheduled_behind_it(model_dir):
    """Behind a step with prompt tokens nothing is scheduled until it ran, so a request that
    arrives meanwhile joins the very next step (behind a decode-only step the next one is
    scheduled at once, two in flight)."""
    from widellm.engine.arg_utils import EngineArgs
    from widellm.engine.engine_core import EngineCore, EngineCoreRequest

    config = EngineArgs(model=model_dir("LlamaForCausalLM"), dtype="float32", num_kv_blocks=32,
                        max_model_len=128, async_scheduling=True).create_engine_config()
    core = EngineCore(config)
    params = SamplingParams(temperature=0, ignore_eos=True)
    try:
        core.add_request(EngineCoreRequest("a", [5, 6, 7], params, [], 8, 0.0))
        first = core.step()  # a's prompt: run and collected, nothing queued behind it
        assert [o.request_id for o in first] == ["a"] and not core.batch_queue
        core.add_request(EngineCoreRequest("b", [8, 9, 10, 11], params, [], 8, 0.0))
        second = core.step()  # a's decode and b's prompt in one step
        assert sorted(o.request_id for o in second) == ["a", "b"] and not core.batch_queue
        assert core.step() == [] and len(core.batch_queue) == 1  # decode only: fill
        assert sorted(o.request_id for o in core.step()) == ["a", "b"]
        assert len(core.batch_queue) == 1  # the next decode step is already in flight
    finally:
        core.shutdown()
