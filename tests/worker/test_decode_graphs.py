"""Decode steps through the persistent step buffers and the graph runner, on CPU: the buffers
hold exactly what a captured CUDA graph reads (padding rows included), the previous step's
sampled ids are fed on the device, and an engine replaying its decode steps through the
graph runner's reference twin gives the eager engine's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from widellm import LLM, SamplingParams
from widellm.ops.cpu_kernels import load_cpu_kernels
from widellm.worker.graph_runner import EagerGraphRunner, make_graph_runner
from widellm.worker.input_batch import BatchInputs
from widellm.worker.sampled_ids import DeviceSampledIds
from widellm.worker.step_buffers import DecodeStepBuffers

BLOCK = 4


def _decode_batch() -> tuple[BatchInputs, torch.Tensor]:
    """Three decoding requests: contexts 5, 9, 2 after this step, block tables 2 wide."""
    context = np.array([5, 9, 2])
    batch = BatchInputs(
        req_ids=["a", "b", "c"],
        input_ids=torch.tensor([11, 12, 13]),
        positions=context - 1,
        query_lens=np.ones(3, dtype=np.int64),
        context_lens=context,
        block_table=np.array([[7, 3], [1, 2], [5, 0]]),
        sample_rows=[0, 1, 2],
    )
    slots = torch.tensor([3 * BLOCK + 0, 2 * BLOCK + 0, 5 * BLOCK + 1])
    return batch, slots


def test_buffers_hold_the_step_then_padding_rows():
    buffers = DecodeStepBuffers(max_rows=8, max_blocks=4, block_size=BLOCK)
    batch, slots = _decode_batch()
    md = buffers.load(batch, slots, size=4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [4, 8, 1, 0]
    assert md.slot_mapping.tolist() == [12, 8, 21, -1]
    assert md.decode_seq_lens.tolist() == [5, 9, 2, 0]
    assert md.decode_block_table.tolist() == [[7, 3, 0, 0], [1, 2, 0, 0], [5, 0, 0, 0],
                                              [0, 0, 0, 0]]
    assert md.padding_mask.tolist() == [False, False, False, True]
    assert (md.num_tokens, md.num_decodes, md.num_actual_tokens, md.prefills) == (4, 4, 3, [])
    # The metadata views the buffers: a graph captured on them sees every later step.
    assert md.decode_seq_lens.data_ptr() == buffers.seq_lens.data_ptr()
    # A smaller step afterwards leaves no row of the larger one behind.
    one = BatchInputs(["c"], torch.tensor([9]), np.array([2]), np.ones(1, dtype=np.int64),
                      np.array([3]), np.array([[5]]), [0])
    md = buffers.load(one, torch.tensor([22]), size=2)
    assert md.decode_seq_lens.tolist() == [3, 0] and md.slot_mapping.tolist() == [22, -1]
    assert md.decode_block_table.tolist() == [[5, 0, 0, 0], [0, 0, 0, 0]]
    assert buffers.input_ids[:2].tolist() == [9, 0]


def test_previous_steps_sampled_ids_feed_the_inputs_on_the_device():
    buffers = DecodeStepBuffers(max_rows=4, max_blocks=2, block_size=BLOCK)
    batch, slots = _decode_batch()
    batch.input_ids = torch.tensor([-1, 12, -1])  # the host does not know a's and c's yet
    prev = DeviceSampledIds(torch.tensor([40, 41, 42]), {"c": 0, "x": 1, "a": 2})
    buffers.load(batch, slots, size=4, prev_sampled=prev)
    assert buffers.input_ids[:4].tolist() == [42, 12, 40, 0]


def test_buffers_refuse_what_a_graph_cannot_replay():
    buffers = DecodeStepBuffers(max_rows=2, max_blocks=2, block_size=BLOCK)
    batch, slots = _decode_batch()
    with pytest.raises(ValueError, match="the buffers hold 2"):
        buffers.load(batch, slots, size=4)
    wide = DecodeStepBuffers(max_rows=4, max_blocks=1, block_size=BLOCK)
    with pytest.raises(ValueError, match="block table of 2 blocks"):
        wide.load(batch, slots, size=4)
    batch.query_lens = np.array([1, 2, 1])
    with pytest.raises(ValueError, match="decode-only"):
        DecodeStepBuffers(4, 2, BLOCK).load(batch, slots, size=4)
    with pytest.raises(ValueError, match="capture sizes"):
        EagerGraphRunner(torch.nn.Identity(), buffers, (1, 2, 4))
    assert isinstance(make_graph_runner(torch.nn.Identity(), buffers, (1, 2)), EagerGraphRunner)


PROMPT_LENS = (3, 9, 17, 30, 41, 5)
MAX_TOKENS = (12, 3, 9, 6, 12, 1)  # finishing at different steps: batches of 6, 5, 4, ... 1


def _run(path: str, sizes: str | None, graphs: bool):
    """Greedy and seeded outputs, and (decode rows, rows run) of every replayed step."""
    with LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256,
             cuda_graph_sizes=sizes) as llm:
        runner = llm.llm_engine.engine_core.model_runner
        replays: list[tuple[int, int]] = []
        if graphs:
            runner.capture_decode_graphs(eager=True)
            run = runner.graphs.run

            def recording(md):
                replays.append((int(md.num_actual_tokens), md.num_tokens))
                return run(md)

            runner.graphs.run = recording
        vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
        params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=m,
                                 ignore_eos=True, logprobs=2)
                  for i, m in enumerate(MAX_TOKENS)]
        outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    return tokens, logprobs, replays


@pytest.mark.skipif(load_cpu_kernels() is None, reason="in-place CPU decode needs the kernels")
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def test_graph_replays_give_the_eager_engines_tokens(model_dir, arch):
    path = model_dir(arch)
    eager_tokens, eager_lp, _ = _run(path, "1,2,4,8", graphs=False)
    tokens, lp, replays = _run(path, "1,2,4,8", graphs=True)
    assert tokens == eager_tokens
    for a, b in zip(lp, eager_lp):
        assert a == pytest.approx(b, abs=1e-5)
    # Every decode-only step (5 rows down to 2: the others carry prompt chunks) replayed at
    # its bucket.
    assert {n for n, _ in replays} == {2, 3, 4, 5}
    assert all(size == {2: 2, 3: 4, 4: 4, 5: 8}[n] for n, size in replays)
    # Steps above the largest capture size run eagerly, with the same tokens.
    small_tokens, _, small = _run(path, "1,2", graphs=True)
    assert small_tokens == eager_tokens
    assert {n for n, _ in small} == {2}
