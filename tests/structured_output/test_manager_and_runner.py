"""The engine core's compile queue and the model runner's matchers, on the real xgrammar
backend over a tiny byte-level tokenizer."""

from __future__ import annotations

import threading

import pytest
import torch

from widellm.core.request import Request, RequestStatus
from widellm.model.preset_tokenizer import build_tokenizer
from widellm.sampling_params import SamplingParams
from widellm.sampling_params import StructuredOutputsParams as S
from widellm.structured_output.bitmask import unpack_bitmask
from widellm.structured_output.manager import StructuredOutputManager
from widellm.structured_output.runner_grammars import RunnerGrammars
from widellm.structured_output.xgrammar_backend import XgrammarBackend

VOCAB = 512
EOS = 0
WAIT_S = 30.0


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(VOCAB)


def _request(req_id: str, params: S) -> Request:
    return Request(req_id, [1, 2, 3], SamplingParams(structured_outputs=params),
                   frozenset([EOS]), 16)


def _drain(manager: StructuredOutputManager):
    ready, failed = [], []
    while manager.has_pending:
        manager.wait(WAIT_S)
        r, f = manager.pop_finished()
        ready += r
        failed += f
    return ready, failed


def test_manager_compiles_off_thread_and_fails_bad_constraints(tokenizer):
    gate = threading.Event()
    built_on = []

    def factory():
        built_on.append(threading.current_thread().name)
        gate.wait(WAIT_S)  # holds every compilation until the test has looked
        return XgrammarBackend(tokenizer, VOCAB, [EOS])

    manager = StructuredOutputManager(factory)
    good, bad = _request("good", S(regex="ab+")), _request("bad", S(regex="a(b"))
    aborted = _request("aborted", S(choice=["x"]))
    for r in (good, bad, aborted):
        manager.add(r)
    assert manager.pop_finished() == ([], [])  # nothing compiled while the backend builds
    assert manager.abort(["aborted", "elsewhere"]) == ["elsewhere"]
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    gate.set()
    ready, failed = _drain(manager)
    assert [r.request_id for r in ready] == ["good"] and good.grammar is not None
    assert [r.request_id for r in failed] == ["bad"]
    assert bad.status == RequestStatus.FINISHED_ERROR
    assert bad.stop_reason == ("structured_outputs: invalid regex: Regex parsing error at "
                               "position 4: The parenthesis is not closed.")
    assert built_on[0].startswith("widellm-grammar")
    assert len(manager.compile_times_s) == 1  # the failed one and the aborted one add none
    manager.shutdown()


def test_runner_masks_only_its_rows_and_replays_after_preemption(tokenizer):
    backend = XgrammarBackend(tokenizer, VOCAB, [EOS])
    grammar = backend.compile(S(choice=["ab", "ac"]))
    grammars = RunnerGrammars(VOCAB)
    grammars.add("s", grammar, [])
    logits = torch.zeros(2, VOCAB)
    grammars.mask_logits_(logits, ["plain", "s"])
    assert logits[0].isfinite().all()  # the unconstrained row is untouched
    a = tokenizer.encode("a", add_special_tokens=False)
    allowed = logits[1].isfinite().nonzero().flatten().tolist()
    assert a[0] in allowed and EOS not in allowed
    # The tokens that start "ab" or "ac" are all the grammar allows first.
    assert all(tokenizer.decode([t]) in ("a", "ab", "ac") for t in allowed)

    ab = tokenizer.encode("ab", add_special_tokens=False)
    # A resumed request's matcher replays what it had produced.
    grammars.add("s", grammar, ab)
    logits = torch.zeros(1, VOCAB)
    grammars.mask_logits_(logits, ["s"])
    assert logits[0].isfinite().nonzero().flatten().tolist() == [EOS]
    assert grammars.accept(["s"], [EOS]) == {"s"}
    # A step scheduled before the finish was seen: no mask, nothing accepted.
    logits = torch.zeros(1, VOCAB)
    grammars.mask_logits_(logits, ["s"])
    assert logits.isfinite().all() and grammars.accept(["s"], [5]) == set()
    with pytest.raises(ValueError, match="breaks its grammar"):
        grammars.add("t", grammar, tokenizer.encode("b", add_special_tokens=False))


def test_bitmask_rows_match_the_matcher(tokenizer):
    backend = XgrammarBackend(tokenizer, VOCAB, [EOS])
    matcher = backend.compile(S(regex="[0-9]")).new_matcher()
    bitmask = torch.zeros(1, 16, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, VOCAB)[0].nonzero().flatten().tolist()
    assert sorted(tokenizer.decode([t]) for t in allowed) == list("0123456789")
