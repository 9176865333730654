"""Output processing for n > 1 in streaming (DELTA) mode: each update carries only the samples
that advanced, and a finished sample is reported finished exactly once."""

from __future__ import annotations

from widellm.core.outputs import EngineCoreOutput
from widellm.engine.output_processor import OutputProcessor, RequestOutputKind, child_request_id
from widellm.sampling_params import SamplingParams


def test_delta_updates_for_two_samples():
    proc = OutputProcessor(tokenizer=None)
    ids = proc.add_request("r", None, [1, 2, 3], SamplingParams(n=2, detokenize=False),
                           RequestOutputKind.DELTA)
    assert ids == [child_request_id("r", 0), child_request_id("r", 1)]

    outs, _ = proc.process_outputs([EngineCoreOutput(ids[0], [7], finish_reason="length"),
                                    EngineCoreOutput(ids[1], [8])])
    assert [(c.index, c.token_ids, c.finish_reason) for c in outs[0].outputs] == [
        (0, [7], "length"), (1, [8], None)]
    assert not outs[0].finished

    outs, _ = proc.process_outputs([EngineCoreOutput(ids[1], [9], finish_reason="stop")])
    # Sample 0 finished earlier and is not repeated.
    assert [(c.index, c.token_ids, c.finish_reason) for c in outs[0].outputs] == [
        (1, [9], "stop")]
    assert outs[0].finished and not proc.has_unfinished_requests()


def test_final_only_joins_samples():
    proc = OutputProcessor(tokenizer=None)
    ids = proc.add_request("r", None, [1], SamplingParams(n=2, detokenize=False),
                           RequestOutputKind.FINAL_ONLY)
    outs, _ = proc.process_outputs([EngineCoreOutput(ids[0], [5], finish_reason="length")])
    assert outs == []  # sample 1 still running
    outs, _ = proc.process_outputs([EngineCoreOutput(ids[1], [6, 7], finish_reason="length")])
    assert [(c.index, c.token_ids) for c in outs[0].outputs] == [(0, [5]), (1, [6, 7])]
