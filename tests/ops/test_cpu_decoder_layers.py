"""The fused decode stack (``llama_decode_layers``; widellm/model/fused_decode.py) against its
reference twin, the layers' own forwards: the same tokens and the same logprobs, bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from widellm import LLM, SamplingParams
from widellm.layers.linear import PACKED_LINEAR_ENV, packed_linear_available
from widellm.model.fused_decode import (
    FUSED_DECODE_ENV, LlamaFusedDecode, enable_fused_decode, fused_decode_enabled,
)

PROMPT_LENS = (5, 9, 17, 30, 33, 48, 64, 100)

# The stacks call oneDNN's packed linears; CPUs without bf16 support in oneDNN (AVX2 ones)
# keep plain bf16 linears, so no bf16 stack is built there
# (test_no_fused_decode_without_packed_linears); fp32 ones are packed wherever oneDNN runs.
needs_packed_linears = pytest.mark.skipif(
    not packed_linear_available(), reason="oneDNN bf16 linear not available on this CPU/torch")


def _prompts(vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=gen).tolist()}
            for n in PROMPT_LENS]


def _run(llm: LLM, prompts: list[dict]) -> list[tuple[list[int], list[dict]]]:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def _decoder(llm: LLM):
    return llm.llm_engine.engine_core.model_runner.model.model


@pytest.mark.parametrize("arch,stack,dtype", [
    pytest.param("LlamaForCausalLM", LlamaFusedDecode, "bfloat16", marks=needs_packed_linears),
    # q/k/v biases
    pytest.param("Qwen2ForCausalLM", LlamaFusedDecode, "bfloat16", marks=needs_packed_linears),
    ("LlamaForCausalLM", LlamaFusedDecode, "float32"),
    ("Qwen2ForCausalLM", LlamaFusedDecode, "float32"),
])
def test_fused_decode_equals_the_layers(arch, stack, dtype, model_dir, kernels, monkeypatch):
    # No prefix caching: the second run must prefill exactly as the first did.
    llm = LLM(model_dir(arch), dtype=dtype, num_kv_blocks=128, max_model_len=256,
              enable_prefix_caching=False)
    try:
        decoder = _decoder(llm)
        fused = decoder.fused_decode
        assert type(fused) is stack
        calls = []
        original = stack.__call__

        def counting(self, ctx, positions, x):
            calls.append(ctx.attn_metadata.num_tokens)
            return original(self, ctx, positions, x)

        monkeypatch.setattr(stack, "__call__", counting)
        prompts = _prompts(llm.llm_engine.config.model_config.hf_config.vocab_size)
        with_fused = _run(llm, prompts)
        # 8 prompts x 19 decode tokens each, in steps of up to 8 sequences.
        assert sum(calls) == len(PROMPT_LENS) * 19 and max(calls) == len(PROMPT_LENS)
        decoder.fused_decode = None
        calls.clear()
        reference = _run(llm, prompts)
        assert calls == []
        assert with_fused == reference
    finally:
        llm.shutdown()


def test_fused_decode_rejects_a_slot_outside_the_cache(model_dir, kernels):
    llm = LLM(model_dir("LlamaForCausalLM"), dtype="float32", num_kv_blocks=8,
              max_model_len=64)
    try:
        decoder = _decoder(llm)
        hidden = decoder.embed_tokens.weight.shape[1]
        md = SimpleNamespace(slot_mapping=torch.tensor([8 * 16]),
                             decode_block_table=torch.zeros(1, 1, dtype=torch.int64),
                             decode_seq_lens=torch.ones(1, dtype=torch.int64))
        with pytest.raises(ValueError, match="slot_mapping"):
            decoder.fused_decode(SimpleNamespace(attn_metadata=md),
                                 torch.zeros(1, dtype=torch.int64),
                                 torch.zeros(1, hidden, dtype=torch.float32))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch,dtype,packed", [
    ("MixtralForCausalLM", "bfloat16", "1"),  # MoE layers: not covered
    # MLA layers: no stack covers them (the DeepSeek one was removed), in either dtype
    ("DeepseekV3ForCausalLM", "bfloat16", "1"),
    ("DeepseekV2ForCausalLM", "float32", "1"),
    ("LlamaForCausalLM", "float32", "0"),  # plain linears: the layers' own path
])
def test_fused_decode_only_where_it_applies(arch, dtype, packed, model_dir, kernels,
                                            monkeypatch):
    monkeypatch.setenv(PACKED_LINEAR_ENV, packed)
    llm = LLM(model_dir(arch), dtype=dtype, num_kv_blocks=32, max_model_len=64)
    try:
        assert _decoder(llm).fused_decode is None
    finally:
        llm.shutdown()


@pytest.mark.skipif(packed_linear_available(), reason="oneDNN runs bf16 linears here")
def test_no_fused_decode_without_packed_linears(model_dir, kernels):
    llm = LLM(model_dir("LlamaForCausalLM"), dtype="bfloat16", num_kv_blocks=32,
              max_model_len=64)
    try:
        assert _decoder(llm).fused_decode is None
    finally:
        llm.shutdown()


def test_fused_decode_switch(model_dir, monkeypatch):
    monkeypatch.setenv(FUSED_DECODE_ENV, "0")
    assert not fused_decode_enabled()
    llm = LLM(model_dir("LlamaForCausalLM"), dtype="bfloat16", num_kv_blocks=32,
              max_model_len=64)
    try:
        model = llm.llm_engine.engine_core.model_runner.model
        assert model.model.fused_decode is None and not enable_fused_decode(model)
    finally:
        llm.shutdown()
    monkeypatch.setenv(FUSED_DECODE_ENV, "maybe")
    with pytest.raises(ValueError, match=FUSED_DECODE_ENV):
        fused_decode_enabled()
