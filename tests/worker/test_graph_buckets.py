"""Decode steps padded to CUDA graph capture sizes, checked on CPU (the same padding a CUDA
engine replays its graphs at): the padded rows change no output, and a step larger than the
largest size runs as it is."""

from __future__ import annotations

import pytest
import torch

from widellm import LLM, SamplingParams
from widellm.worker.graph_buckets import bucket_for, default_capture_sizes

PROMPT_LENS = (3, 9, 17, 30, 41, 5)
MAX_TOKENS = (12, 3, 9, 6, 12, 1)  # finishing at different steps: batches of 6, 5, 4, ... 1


def test_default_sizes_are_vllms():
    assert default_capture_sizes(256)[:6] == (1, 2, 4, 8, 16, 24)
    assert default_capture_sizes(256)[-1] == 256 and len(default_capture_sizes(256)) == 35
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert default_capture_sizes(2) == (1, 2)
    assert default_capture_sizes(4096)[-1] == 512


@pytest.mark.parametrize("rows, bucket", [(1, 1), (3, 4), (4, 4), (5, 8), (8, 8), (9, None)])
def test_bucket_is_the_smallest_size_that_holds_the_step(rows, bucket):
    assert bucket_for(rows, (1, 2, 4, 8)) == bucket
    assert bucket_for(rows, ()) is None


def _run(path: str, sizes: str | None):
    """Greedy outputs, and the row counts of every decode-only step's forward."""
    with LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256,
             cuda_graph_sizes=sizes) as llm:
        runner = llm.llm_engine.engine_core.model_runner
        rows: list[tuple[int, int]] = []
        prepare = runner.prepare_model_input

        def recording(so):
            inp = prepare(so)
            if inp is not None and not inp.attn_metadata.prefills:
                rows.append((inp.attn_metadata.num_decodes, inp.num_rows))
            return inp

        runner.prepare_model_input = recording
        vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
                  for m in MAX_TOKENS]
        outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    return tokens, logprobs, rows


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def test_padded_decode_steps_give_the_same_tokens(model_dir, arch):
    path = model_dir(arch)
    eager_tokens, eager_lp, eager_rows = _run(path, None)
    tokens, lp, rows = _run(path, "1,2,4,8")
    assert tokens == eager_tokens
    for a, b in zip(lp, eager_lp):  # other row counts round differently, in the last bits
        assert a == pytest.approx(b, abs=1e-5)
    assert all(r == d for d, r in eager_rows)  # eager: no padding rows
    assert rows and all(r == bucket_for(d, (1, 2, 4, 8)) for d, r in rows)
    assert any(r > d for d, r in rows)  # some step was padded
    # Above the largest size: run as it is.
    small_tokens, _, small_rows = _run(path, "1,2")
    assert small_tokens == eager_tokens
    assert all(r == (bucket_for(d, (1, 2)) or d) for d, r in small_rows)
    assert any(d > 2 and r == d for d, r in small_rows)
