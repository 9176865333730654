"""The GPU path's attention wiring, checked on CPU: the engine with ``attention_backend=
"triton"`` (the Triton K/V store and decode kernels, here in Triton's interpreter) generates
exactly what the CPU backend generates, on a GQA Llama and on DeepSeek-V3's MLA, through
chunked prompts and decode steps."""

from __future__ import annotations

import pytest
import torch

from widellm import LLM, SamplingParams

PROMPT_LENS = (5, 23, 40)
MAX_TOKENS = 5
CHUNK = 16  # step budget: the longer prompts are chunked, their later chunks read the cache


def _run(path: str, backend: str):
    with LLM(path, dtype="float32", num_kv_blocks=32, max_model_len=128,
             max_num_batched_tokens=CHUNK, attention_backend=backend) as llm:
        assert llm.llm_engine.config.model_config.attention_backend == backend
        runner = llm.llm_engine.engine_core.model_runner
        vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                logprobs=1)
        outs = llm.generate(prompts, params, use_tqdm=False)
        in_place = runner.decode_in_place
    return ([o.outputs[0].token_ids for o in outs],
            [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
             for o in outs], in_place)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def test_triton_backend_generates_what_the_cpu_backend_does(model_dir, arch):
    path = model_dir(arch)
    cpu_tokens, cpu_lp, _ = _run(path, "cpu")
    tokens, lp, in_place = _run(path, "triton")
    assert in_place  # the Triton backend reads the paged cache in place
    assert tokens == cpu_tokens
    for a, b in zip(lp, cpu_lp):  # other kernels sum in another order: fp32 rounding only
        assert a == pytest.approx(b, abs=1e-4)
