"""Async scheduling on expert-parallel ranks under a KV pool small enough to preempt: greedy
outputs (with finish reasons and stop rules) equal synchronous lockstep and one rank, the
preemptions did happen, and every rank's pool ends empty. The runner thread owns the vote and
the forwards, so a preempted request's state is dropped in step order on the rank holding it
while the other rank, which never gets a request, runs dummy batches."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_async_scheduling import IGNORE_EOS, MAX_TOKENS, POOL_BLOCKS, PROMPT_LENS
from widellm import LLM, SamplingParams

ARCH = "Qwen3MoeForCausalLM"
# Every prompt on rank 0, whose small pool then preempts as one rank's does; rank 1 never gets
# a request and runs only dummy batches.
PLACEMENT = [0] * len(PROMPT_LENS)


def _run(path: str, **kwargs):
    with LLM(path, dtype="float32", num_kv_blocks=POOL_BLOCKS, max_model_len=POOL_BLOCKS * 16,
             **kwargs) as llm:
        vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=e)
                  for m, e in zip(MAX_TOKENS, IGNORE_EOS)]
        ranks = PLACEMENT if kwargs.get("data_parallel_size", 1) > 1 else None
        outs = llm.generate(prompts, params, use_tqdm=False, data_parallel_rank=ranks)
        client = llm.llm_engine.client
        preemptions = None
        if client is not None:
            assert all(s.kv_cache_usage == 0 for s in client.last_stats.values())
            preemptions = client.last_stats[0].num_preemptions
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], preemptions


@pytest.mark.parametrize("backend", ["allgather_reducescatter", "all2all"])
def test_async_lockstep_with_preemption_equals_sync_and_one_rank(model_dir, backend):
    path = model_dir(ARCH)
    expected, _ = _run(path)
    ep = dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend=backend)
    got_sync, pre_sync = _run(path, **ep)
    got_async, pre_async = _run(path, async_scheduling=True, **ep)
    assert got_sync == expected
    assert got_async == expected
    assert pre_sync > 0 and pre_async > 0
