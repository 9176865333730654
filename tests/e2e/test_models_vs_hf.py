"""Greedy outputs equal Hugging Face transformers token for token (fp32), for every supported
architecture, under four engine set-ups: plain (with prefix-cache hits), chunked prefill with a
32-token budget, forced preemption, and a second identical call served from the cache. After
every run all KV blocks are back in the free pool."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_MODELS, hf_greedy
from widellm import LLM, SamplingParams

PROMPT_LENS = (5, 17, 40, 64, 100, 150, 250, 300)
MAX_NEW_TOKENS = 32
SHARED_PREFIX = 96  # prompts of >= 100 tokens start alike: 6 full blocks to hit
CHUNK_BUDGET = 32
# 300 + 32 tokens need 21 blocks of 16; a pool of 24 fits the longest request alone but not
# the batch, so the scheduler must preempt and recompute.
SMALL_POOL_BLOCKS = 24
PLENTY_BLOCKS = 512


def make_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    # Skip the lowest ids: the presets' special tokens live there.
    prefix = torch.randint(3, vocab_size, (SHARED_PREFIX,), generator=g).tolist()
    prompts = []
    for n in PROMPT_LENS:
        body = torch.randint(3, vocab_size, (n,), generator=g).tolist()
        prompts.append(prefix + body[SHARED_PREFIX:] if n > SHARED_PREFIX else body)
    return prompts


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def case(request, model_dir):
    arch = request.param
    path = model_dir(arch)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = make_prompts(vocab)
    return arch, path, prompts, hf_greedy(path, prompts, MAX_NEW_TOKENS)


def run(path: str, prompts, **engine_kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_NEW_TOKENS for o in outs)
    return [o.outputs[0].token_ids for o in outs], llm


def assert_pool_empty(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks
    assert not kv.req_to_blocks
    assert not core.scheduler.requests
    # The runner drops finished requests' state when the next step tells it to.
    assert set(core.model_runner.states) <= core.scheduler.finished_req_ids


def test_plain_with_prefix_hits(case):
    arch, path, prompts, expected = case
    got, llm = run(path, prompts, num_kv_blocks=PLENTY_BLOCKS)
    assert got == expected
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    # The four prompts sharing 96 tokens: each of the last three hits 6 blocks.
    assert kv.prefix_cache_hits >= 3 * SHARED_PREFIX
    assert_pool_empty(llm)

    # Same prompts again: now every prompt is served mostly from revived cached blocks.
    hits_before = kv.prefix_cache_hits
    again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS,
                                                 ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert kv.prefix_cache_hits - hits_before >= sum((n - 1) // 16 * 16 for n in PROMPT_LENS)
    assert_pool_empty(llm)


def test_chunked_prefill(case):
    arch, path, prompts, expected = case
    got, llm = run(path, prompts, num_kv_blocks=PLENTY_BLOCKS,
                   max_num_batched_tokens=CHUNK_BUDGET, enable_prefix_caching=False)
    assert got == expected
    assert_pool_empty(llm)


def test_preemption(case):
    arch, path, prompts, expected = case
    got, llm = run(path, prompts, num_kv_blocks=SMALL_POOL_BLOCKS,
                   max_model_len=SMALL_POOL_BLOCKS * 16)
    assert got == expected
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert_pool_empty(llm)


# Rows a prompt-carrying step is padded to a multiple of: not a power of two, so nearly every
# such step gets 1-47 padding rows (token 0, no KV slot, no expert).
ODD_PAD_MULTIPLE = 48


def test_padded_prompt_steps(case):
    arch, path, prompts, expected = case
    llm = LLM(path, dtype="float32", num_kv_blocks=PLENTY_BLOCKS,
              prefill_pad_multiple=ODD_PAD_MULTIPLE)
    rows: list[int] = []
    model = llm.llm_engine.engine_core.model_runner.model
    model.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[0]))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    # Prompt steps (wider than the batch) are whole multiples; decode-only steps are not padded.
    prompt_rows = [n for n in rows if n > len(prompts)]
    assert prompt_rows and all(n % ODD_PAD_MULTIPLE == 0 for n in prompt_rows)
    assert any(n % ODD_PAD_MULTIPLE for n in rows if n <= len(prompts))
    assert_pool_empty(llm)
