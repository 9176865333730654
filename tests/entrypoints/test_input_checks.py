"""The request-body value checks, on their own and through the request models."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from widellm.entrypoints.input_checks import INT64_MAX, INT64_MIN, check_json_values
from widellm.entrypoints.protocol import CompletionRequest
from widellm.entrypoints.protocol_chat import ChatCompletionRequest


def test_int64_bounds_are_inclusive_and_bools_pass():
    check_json_values({"seed": INT64_MAX, "top_k": INT64_MIN, "stream": True, "n": 1})
    with pytest.raises(ValueError, match=r"^seed: seed must fit in a signed 64-bit integer$"):
        check_json_values({"seed": INT64_MAX + 1})
    with pytest.raises(ValueError, match=r"^top_k: top_k must fit"):
        check_json_values({"top_k": INT64_MIN - 1})


@pytest.mark.parametrize("value, shown", [(float("nan"), "nan"), (float("inf"), "inf"),
                                          (float("-inf"), "-inf")])
def test_non_finite_floats_name_their_field(value, shown):
    with pytest.raises(ValueError) as e:
        check_json_values({"frequency_penalty": value})
    assert str(e.value) == (f"frequency_penalty: frequency_penalty must be a finite number, "
                            f"got {shown}")


def test_nested_values_and_keys_name_the_top_field_and_the_path():
    with pytest.raises(ValueError) as e:
        check_json_values({"messages": [{"role": "user", "content": "ok"},
                                        {"role": "user", "content": "x\ud800"}]})
    assert str(e.value) == ("messages: messages.1.content is not valid Unicode "
                            "(a lone surrogate at character 1)")
    with pytest.raises(ValueError, match=r"^chat_template_kwargs: a key in "):
        check_json_values({"chat_template_kwargs": {"\udfff": 1}})
    with pytest.raises(ValueError, match=r"^a top-level key is not valid Unicode"):
        check_json_values({"\ud800": 1})


def test_deep_nesting_does_not_exhaust_the_stack():
    body: dict = {"stop_token_ids": []}
    inner = body["stop_token_ids"]
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]
    inner.append(2 ** 64)
    pattern = r"^stop_token_ids: stop_token_ids(\.0){100001} must"
    with pytest.raises(ValueError, match=pattern):
        check_json_values(body)


def test_request_models_refuse_them():
    with pytest.raises(ValidationError, match="temperature must be a finite number"):
        CompletionRequest.model_validate({"prompt": "hi", "temperature": float("nan")})
    with pytest.raises(ValidationError, match="messages.0.content is not valid Unicode"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user",
                                                            "content": "\ud800"}]})
    ok = CompletionRequest.model_validate({"prompt": "hi", "temperature": 0.5, "seed": 7})
    assert (ok.temperature, ok.seed) == (0.5, 7)


def test_bulk_checks_still_name_the_bad_value():
    """Wide levels are checked in bulk; a bad value among many is still found and named."""
    messages = [{"role": "user", "content": "ok"} for _ in range(5000)]
    messages[3217]["content"] = "a\ud800"
    with pytest.raises(ValueError, match=r"^messages: messages\.3217\.content is not valid"):
        check_json_values({"messages": messages})
    ids = [[1, 2]] * 4000 + [[3, INT64_MAX + 1]]
    with pytest.raises(ValueError, match=r"^prompt: prompt\.4000\.1 must fit"):
        check_json_values({"prompt": ids})
    bias = {str(i): 1.5 for i in range(3000)} | {"77": float("inf")}
    with pytest.raises(ValueError, match=r"^logit_bias: logit_bias\.77 must be a finite"):
        check_json_values({"logit_bias": bias})
    check_json_values({"messages": [{"role": "user", "content": "fine"}] * 5000,
                       "prompt": [[1, True, INT64_MIN]] * 3000, "bias": {"1": 0.5}})


@pytest.mark.parametrize("prompt,ok", [
    ([1, 2], True), (["a", "b"], True), ([[1], [2, 3]], True), ("a", True),
    ([True, 1], False), ([1, "a"], False), ([[1], []], False), ([[1], ["a"]], False),
    ([], False), ([[1], 2], False), ([1.0], False),
])
def test_prompt_shapes_by_the_fast_path_match_the_union(prompt, ok):
    if ok:
        assert CompletionRequest(prompt=prompt).prompt == prompt
    else:
        with pytest.raises(ValidationError):
            CompletionRequest(prompt=prompt)
