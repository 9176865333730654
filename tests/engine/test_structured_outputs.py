"""Structured outputs inside the engine, on a tiny random MoE model (the constraint does all
the work): constrained requests batched with unconstrained ones leave theirs token-for-token
unchanged, under chunked prefill, preemption, prefix caching and async scheduling, on one
rank and on two expert-parallel ranks; and the constrained outputs follow their constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tests.structured_output.schemas import SCHEMAS
from widellm import LLM, SamplingParams
from widellm.sampling_params import StructuredOutputsParams as S

ARCH = "Qwen3MoeForCausalLM"
POOL_BLOCKS = 24  # the 300-token prompts preempt their neighbours in this pool
CHUNK = 64  # step token budget: longer prompts are chunked
PLAIN_LENS = (5, 33, 100, 300)
PLAIN_MAX_TOKENS = (24, 12, 30, 16)
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["alpha", "beta gamma"]
MAX_TOKENS = 120
# Prompt, constraint, sampling of each constrained request; the long prompts make them the
# most recently admitted, so the preemptions fall on them and their grammars get replayed.
STRUCTURED = [
    (250, S(json=SCHEMAS[0]), {"temperature": 0.0}),
    (280, S(json=SCHEMAS[4]), {"temperature": 0.8, "seed": 7}),
    (17, S(regex=REGEX), {"temperature": 1.0, "seed": 3}),
    (9, S(choice=CHOICES), {"temperature": 0.0}),
    (260, S(json_object=True), {"temperature": 0.0}),
]


def _prompts(vocab: int, lens, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _run(path: str, with_structured: bool, **kwargs):
    """(plain outputs, structured outputs, preemptions) of one engine."""
    with LLM(path, dtype="float32", num_kv_blocks=POOL_BLOCKS, max_model_len=POOL_BLOCKS * 16,
             max_num_batched_tokens=CHUNK,
             structured_outputs_config={"disable_any_whitespace": True}, **kwargs) as llm:
        vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
        prompts = _prompts(vocab, PLAIN_LENS, 0)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                  for m in PLAIN_MAX_TOKENS]
        if with_structured:
            prompts += _prompts(vocab, [n for n, _, _ in STRUCTURED], 1)
            params += [SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=c, **s)
                       for _, c, s in STRUCTURED]
        ranks = None
        if kwargs.get("data_parallel_size", 1) > 1:
            ranks = [i % 2 for i in range(len(prompts))]
        outs = llm.generate(prompts, params, use_tqdm=False, data_parallel_rank=ranks)
        # The same constrained prompts again: their prefixes come from the cache.
        again = []
        if with_structured:
            again = llm.generate(prompts[len(PLAIN_LENS):], params[len(PLAIN_LENS):],
                                 use_tqdm=False, data_parallel_rank=ranks and ranks[:5])
        core = llm.llm_engine.engine_core
        preemptions = core.scheduler.num_preemptions if core is not None else None
        # Decoded alone: a random prompt may end inside a UTF-8 character, which the
        # streamed text would then begin with.
        decode = llm.llm_engine.tokenizer.decode
        result = [(o.outputs[0].token_ids,
                   decode(o.outputs[0].token_ids, skip_special_tokens=True),
                   o.outputs[0].finish_reason) for o in outs]
    return (result[:len(PLAIN_LENS)], result[len(PLAIN_LENS):],
            [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in again], preemptions)


def _check_constraints(structured) -> None:
    (_, t0, r0), (_, t1, r1), (_, t2, r2), (_, t3, r3), (_, t4, r4) = structured
    assert (r0, r1, r2, r3, r4) == ("stop",) * 5
    jsonschema.validate(json.loads(t0), SCHEMAS[0])
    jsonschema.validate(json.loads(t1), SCHEMAS[4])
    assert re.fullmatch(REGEX, t2)
    assert t3 in CHOICES
    assert isinstance(json.loads(t4), dict)


@pytest.fixture(scope="module")
def one_rank(model_dir):
    path = model_dir(ARCH)
    return {async_: (_run(path, False, async_scheduling=async_),
                     _run(path, True, async_scheduling=async_)) for async_ in (False, True)}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constrained_requests_leave_their_neighbours_unchanged(one_rank, async_scheduling):
    alone, mixed = one_rank[async_scheduling]
    plain_alone, _, _, _ = alone
    plain_mixed, structured, again, preemptions = mixed
    assert plain_mixed == plain_alone
    _check_constraints(structured)
    assert preemptions > 0
    # A second run over cached prefixes generates the same constrained tokens.
    assert again == [(ids, reason) for ids, _, reason in structured]


def test_async_scheduling_generates_the_same_constrained_tokens(one_rank):
    assert one_rank[True][1][1] == one_rank[False][1][1]


def test_two_expert_parallel_ranks_with_async_scheduling(model_dir, one_rank):
    path = model_dir(ARCH)
    plain, structured, _, _ = _run(path, True, data_parallel_size=2,
                                   enable_expert_parallel=True, async_scheduling=True)
    single_plain, single_structured, _, _ = one_rank[False][1]
    assert plain == single_plain
    assert structured == single_structured


def test_a_complete_grammar_ends_the_request_whatever_min_tokens_and_ignore_eos_say(model_dir):
    """Once the grammar is complete only EOS is allowed: min_tokens cannot mask it (the row
    would have no token left) and ignore_eos cannot continue past it."""
    with LLM(model_dir(ARCH), dtype="float32", num_kv_blocks=POOL_BLOCKS,
             max_model_len=POOL_BLOCKS * 16) as llm:
        eos = list(llm.llm_engine.processor.eos_token_ids)
        prompts = _prompts(llm.llm_engine.config.model_config.hf_config.vocab_size, (7, 7), 2)
        outs = llm.generate(prompts, [
            SamplingParams(temperature=0, max_tokens=50, min_tokens=40,
                           structured_outputs=S(choice=CHOICES)),
            SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                           structured_outputs=S(choice=CHOICES)),
        ], use_tqdm=False)
        decode = llm.llm_engine.tokenizer.decode
    for out in outs:
        ids = out.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "stop"
        assert ids[-1] in eos and len(ids) < 40
        assert decode(ids[:-1]) in CHOICES


def test_deferred_sampled_ids_around_constrained_requests(model_dir, one_rank, monkeypatch):
    """Sampled ids reaching the host behind the next step (as on a GPU with async scheduling):
    steps with a grammar resolve theirs at once, the others defer, and the tokens are the
    immediate engine's."""
    from widellm.worker.model_runner import TEST_DEFER_SAMPLED_IDS_ENV

    monkeypatch.setenv(TEST_DEFER_SAMPLED_IDS_ENV, "1")
    plain, structured, again, _ = _run(model_dir(ARCH), True, async_scheduling=True)
    immediate_plain, immediate_structured, immediate_again, _ = one_rank[True][1]
    assert plain == immediate_plain
    assert structured == immediate_structured and again == immediate_again
