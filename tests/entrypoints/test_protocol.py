"""OpenAI request models on their own: which shapes they accept, what SamplingParams they
become, and the JSON the error and delta models produce."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from widellm.entrypoints.errors import APIError, param_of, to_api_error
from widellm.entrypoints.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS, MAX_LOGPROBS, CompletionRequest, DetokenizeRequest,
)
from widellm.entrypoints.protocol_chat import ChatCompletionRequest, DeltaMessage, TokenizeRequest
from widellm.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("prompt, prompts", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_completion_accepts_the_four_prompt_shapes(prompt, prompts):
    assert CompletionRequest(prompt=prompt).prompts() == prompts


@pytest.mark.parametrize("prompt", [5, None, [], [[]], ["a", 1], [True, 2], ["1", "2", 3],
                                   [1.5], [[1], "a"]])
def test_completion_rejects_other_prompts(prompt):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": prompt})


def test_completion_requires_a_prompt():
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate({"max_tokens": 4})
    assert err.value.errors()[0]["loc"] == ("prompt",)


def test_completion_defaults_follow_openai():
    params = CompletionRequest(prompt="x").to_sampling_params()
    assert params.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS == 16
    assert (params.n, params.temperature, params.top_p, params.logprobs,
            params.prompt_logprobs) == (1, 1.0, 1.0, None, None)


def test_completion_fields_reach_sampling_params():
    request = CompletionRequest.model_validate({
        "prompt": "x", "n": 3, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.2, "seed": 11, "stop": "\n", "stop_token_ids": [4],
        "ignore_eos": True, "min_tokens": 2, "logprobs": 3, "user": "u", "unknown_field": 1,
    })
    p = request.to_sampling_params()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (
        3, 7, 0.5, 0.9, 5, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.seed) == (
        0.5, -0.5, 1.2, 11)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.min_tokens) == (["\n"], [4], True, 2)
    assert (p.logprobs, p.prompt_logprobs) == (3, None)


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    p = CompletionRequest(prompt="x", echo=True, logprobs=2).to_sampling_params()
    assert (p.logprobs, p.prompt_logprobs) == (2, 2)
    assert CompletionRequest(prompt="x", echo=True).to_sampling_params().prompt_logprobs is None


def test_null_sampling_fields_mean_the_defaults():
    request = CompletionRequest.model_validate({"prompt": "x", "temperature": None,
                                                "top_p": None, "max_tokens": None})
    p = request.to_sampling_params()
    assert (p.temperature, p.top_p, p.max_tokens) == (1.0, 1.0, None)


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -1.0, "temperature must be >= 0, got -1.0"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
    ("n", 0, "n must be >= 1, got 0"),
    ("logprobs", MAX_LOGPROBS + 1, f"logprobs must be <= {MAX_LOGPROBS}, got 21"),
])
def test_out_of_range_values_raise_value_errors_naming_the_field(field, value, message):
    request = CompletionRequest.model_validate({"prompt": "x", field: value})
    with pytest.raises(ValueError) as err:
        request.to_sampling_params()
    assert str(err.value) == message
    assert param_of(str(err.value)) == field


def test_chat_max_completion_tokens_wins_and_is_named_in_errors():
    request = ChatCompletionRequest(messages=MESSAGES, max_tokens=5, max_completion_tokens=9)
    assert request.to_sampling_params().max_tokens == 9
    assert ChatCompletionRequest(messages=MESSAGES).to_sampling_params().max_tokens is None
    bad = ChatCompletionRequest(messages=MESSAGES, max_completion_tokens=0)
    with pytest.raises(ValueError, match="^max_completion_tokens must be >= 1, got 0$"):
        bad.to_sampling_params()


def test_chat_logprobs_mapping():
    assert ChatCompletionRequest(messages=MESSAGES).to_sampling_params().logprobs is None
    assert ChatCompletionRequest(messages=MESSAGES,
                                 logprobs=True).to_sampling_params().logprobs == 0
    assert ChatCompletionRequest(messages=MESSAGES, logprobs=True,
                                 top_logprobs=4).to_sampling_params().logprobs == 4
    with pytest.raises(ValueError, match="^top_logprobs: requires logprobs=true$"):
        ChatCompletionRequest(messages=MESSAGES, top_logprobs=2).to_sampling_params()
    with pytest.raises(ValueError, match=r"^top_logprobs must be in \[0, 20\], got 21$"):
        ChatCompletionRequest(messages=MESSAGES, logprobs=True,
                              top_logprobs=21).to_sampling_params()


def test_chat_messages_become_template_dicts():
    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b"}], "name": "ann"},
        {"role": "assistant", "content": None},
    ]})
    assert [m.to_template_dict() for m in request.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": ""},
    ]
    assert request.add_generation_prompt is True


@pytest.mark.parametrize("body", [
    {"messages": []},
    {},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
])
def test_chat_rejects_bad_messages(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_stream_options():
    assert CompletionRequest(prompt="x").include_usage is False
    request = CompletionRequest.model_validate(
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert request.stream and request.include_usage


def test_tokenize_takes_exactly_one_input():
    assert TokenizeRequest(prompt="x").messages is None
    assert TokenizeRequest.model_validate({"messages": MESSAGES}).prompt is None
    for body in [{}, {"prompt": "x", "messages": MESSAGES}]:
        with pytest.raises(ValidationError, match="give exactly one of prompt or messages"):
            TokenizeRequest.model_validate(body)
    with pytest.raises(ValidationError):
        DetokenizeRequest.model_validate({"tokens": ["a"]})


def test_error_body_shape():
    err = APIError.from_value_error(ValueError("top_k must be >= 0, got -2"))
    assert err.to_model().model_dump() == {"error": {
        "message": "top_k must be >= 0, got -2", "type": "BadRequestError", "param": "top_k",
        "code": 400}}
    assert to_api_error(ValueError("prompt: must not be empty")).param == "prompt"
    assert to_api_error(RuntimeError("boom")).to_model().error.type == "InternalServerError"
    assert APIError("gone", 404, "model").to_model().error.type == "NotFoundError"
    assert param_of("The model `x` does not exist") is None


def test_delta_lists_only_what_it_carries():
    assert DeltaMessage(role="assistant", content="").model_dump() == {"role": "assistant",
                                                                       "content": ""}
    assert DeltaMessage(content="hi").model_dump() == {"content": "hi"}
    assert DeltaMessage().model_dump_json() == "{}"


def test_sampling_params_are_fresh_per_call():
    request = CompletionRequest(prompt="x", stop=["a"])
    first, second = request.to_sampling_params(), request.to_sampling_params()
    assert isinstance(first, SamplingParams) and first is not second
    first.stop.append("b")
    assert second.stop == ["a"] and request.stop == ["a"]
