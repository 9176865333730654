"""Incremental detokenization: multi-byte characters split across tokens, stop strings that
span steps, and the held-back tail while streaming."""

from __future__ import annotations

import pytest

from widellm.engine.detokenizer import IncrementalDetokenizer
from widellm.engine.tokenizer import get_tokenizer
from widellm.model.default_model import default_model_path

TEXT = " héllo wörld 日本語 🙂 done."


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(default_model_path())


def stream(tok, ids, stop=(), include=False, prompt=(1,)):
    detok = IncrementalDetokenizer(tok, list(prompt), list(stop), True, include)
    deltas, matched = [], None
    for t in ids:
        matched = detok.update([t])
        deltas.append(detok.get_delta(finished=matched is not None))
        if matched:
            break
    return detok, deltas, matched


def test_multibyte_characters_split_across_tokens(tokenizer):
    ids = tokenizer(TEXT).input_ids
    # Byte-level BPE splits the emoji and CJK characters over several tokens.
    assert len(ids) > len(TEXT.split())
    detok, deltas, _ = stream(tokenizer, ids)
    assert detok.text == TEXT
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)  # never a half character


def test_stop_string_spanning_tokens_is_cut(tokenizer):
    ids = tokenizer(TEXT).input_ids
    detok, deltas, matched = stream(tokenizer, ids, stop=["日本"])
    assert matched == "日本"
    assert detok.text == " héllo wörld "
    assert "".join(deltas) == " héllo wörld "  # nothing past the stop was ever emitted


def test_include_stop_string(tokenizer):
    ids = tokenizer(TEXT).input_ids
    detok, _, matched = stream(tokenizer, ids, stop=["wörld"], include=True)
    assert detok.text == " héllo wörld"


def test_partial_stop_is_held_back_then_released(tokenizer):
    ids = tokenizer(" abc abd").input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], ["abd!"], True, False)
    emitted = ""
    for t in ids:
        assert detok.update([t]) is None
        emitted += detok.get_delta(finished=False)
    # The last len("abd!") - 1 = 3 characters could still start the stop string.
    assert emitted == " abc "[: len(" abc abd") - 3]
    emitted += detok.get_delta(finished=True)
    assert emitted == " abc abd"
