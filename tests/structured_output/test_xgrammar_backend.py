"""The xgrammar backend on a tiny byte-level tokenizer: what each kind of constraint accepts,
its stop at EOS, and the messages invalid constraints get."""

from __future__ import annotations

import pytest

from widellm.model.preset_tokenizer import build_tokenizer
from widellm.sampling_params import StructuredOutputsParams as S
from widellm.structured_output.xgrammar_backend import XgrammarBackend

VOCAB = 512
EOS = 0


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return XgrammarBackend(tokenizer, VOCAB, [EOS])


def _accepts(backend, tokenizer, params: S, text: str) -> bool:
    """Whether the grammar takes ``text`` and then EOS, ending there."""
    matcher = backend.compile(params).new_matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (all(matcher.accept_token(t) for t in ids) and matcher.accept_token(EOS)
            and matcher.is_terminated())


@pytest.mark.parametrize("params, good, bad", [
    (S(json={"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}),
     '{"a": 2}', '{"a": 3}'),
    (S(json_object=True), '{"k": [1, "v"]}', '[1]'),
    (S(regex=r"[0-9]{3}-[a-z]{2}"), "123-ab", "12-ab"),
    (S(choice=['say "hi"', "back\\slash", "two\nlines"]), "back\\slash", "back"),
    (S(grammar='root ::= "x" ("y" | "z")*'), "xyzzy", "yx"),
])
def test_each_kind_accepts_its_language_only(backend, tokenizer, params, good, bad):
    assert _accepts(backend, tokenizer, params, good)
    assert not _accepts(backend, tokenizer, params, bad)


def test_choices_with_quotes_and_newlines_are_literal(backend, tokenizer):
    params = S(choice=['say "hi"', "two\nlines"])
    assert _accepts(backend, tokenizer, params, 'say "hi"')
    assert _accepts(backend, tokenizer, params, "two\nlines")


def test_compact_json_has_no_free_whitespace(backend, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert _accepts(backend, tokenizer, S(json=schema), '{ "a" :\n 1 }')
    assert not _accepts(backend, tokenizer, S(json=schema, disable_any_whitespace=True),
                        '{ "a" :\n 1 }')


def test_a_terminated_matcher_is_reported_and_takes_nothing_more(backend, tokenizer):
    matcher = backend.compile(S(choice=["ab"])).new_matcher()
    for t in tokenizer.encode("ab", add_special_tokens=False):
        assert matcher.accept_token(t)
    assert not matcher.is_terminated()
    assert matcher.accept_token(EOS) and matcher.is_terminated()


@pytest.mark.parametrize("params, message", [
    (S(json='{"type": "object"'), "invalid JSON schema: the schema is not valid JSON: "
                                  "Expecting ',' delimiter: line 1 column 18 (char 17)"),
    (S(json={"type": "frobnicate"}), 'invalid JSON schema: Unsupported type "frobnicate"'),
    (S(regex="a(b"), "invalid regex: Regex parsing error at position 4: The parenthesis is "
                     "not closed."),
    (S(grammar='root ::= "a" |'), "invalid EBNF grammar: EBNF parser error at line 1, "
                                  "column 15: Expect element, but got "),
])
def test_invalid_constraints_raise_value_errors_saying_what(backend, params, message):
    with pytest.raises(ValueError) as err:
        XgrammarBackend.validate(params)
    assert str(err.value).strip() == message.strip()
    with pytest.raises(ValueError) as err:
        backend.compile(params)
    assert str(err.value).strip() == message.strip()


@pytest.mark.parametrize("kwargs, message", [
    ({}, "structured_outputs: give exactly one of json, regex, choice, grammar or "
         "json_object, got none"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs: give exactly one of json, regex, "
                                      "choice, grammar or json_object, got ['regex', 'choice']"),
    ({"choice": []}, "structured_outputs.choice: must be a non-empty list of non-empty "
                     "strings"),
    ({"choice": ["a", ""]}, "structured_outputs.choice: must be a non-empty list of non-empty "
                            "strings"),
])
def test_params_take_exactly_one_constraint(kwargs, message):
    with pytest.raises(ValueError) as err:
        S(**kwargs)
    assert str(err.value) == message


def test_bounded_json_strings_refuse_raw_control_characters(backend, tokenizer):
    """JSON forbids unescaped control characters in strings; xgrammar's own bounded-string
    rule lets them through, the backend's does not."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6}},
              "required": ["a"]}
    assert _accepts(backend, tokenizer, S(json=schema), '{"a": "hello"}')
    assert not _accepts(backend, tokenizer, S(json=schema), '{"a": "x\x13"}')
    assert not _accepts(backend, tokenizer, S(json=schema), '{"a": "toolong"}')
