"""Every field of the OpenAI request schemas (as the ``openai`` SDK declares them) has a
decision in ``widellm/entrypoints/request_fields.py``: honoured fields are declared on our
request models, rejected ones are a 400 naming them when sent with a value that asks for
something, and the rest are accepted. A field the SDK adds fails here until someone decides."""

from __future__ import annotations

import typing

import pytest
from fastapi.exceptions import RequestValidationError
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from pydantic import ValidationError

from widellm.entrypoints.api_server import _validation_error
from widellm.entrypoints.protocol import CompletionRequest
from widellm.entrypoints.protocol_chat import ChatCompletionRequest
from widellm.entrypoints.request_fields import (
    CHAT_FIELDS, COMPLETION_FIELDS, HONOURED, NO_EFFECT, REJECTED, VLLM_CHAT_UNSUPPORTED,
    VLLM_COMPLETION_UNSUPPORTED,
)

MESSAGES = [{"role": "user", "content": "hi"}]
BASE_BODIES = {"chat": {"messages": MESSAGES}, "completions": {"prompt": "hi"}}
MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
TABLES = {"chat": CHAT_FIELDS, "completions": COMPLETION_FIELDS}
VLLM_TABLES = {"chat": VLLM_CHAT_UNSUPPORTED, "completions": VLLM_COMPLETION_UNSUPPORTED}

# A value of each rejected field that asks for what is not supported.
ASKING = {
    "suffix": "the end.",
    "best_of": 3,
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"},
    "verbosity": "low",
    "use_beam_search": True,
    "length_penalty": 0.5,
    "bad_words": ["x"],
    "logits_processors": ["pkg.Proc"],
    "spaces_between_special_tokens": False,
    "mm_processor_kwargs": {"x": 1},
    "vllm_xargs": {"k": 1},
    "prompt_embeds": "AAAA",
    "echo": True,
}
# Values of rejected fields that ask for nothing, so they are accepted.
INERT = {
    "suffix": ["", None],
    "best_of": [1, None],
    "modalities": [["text"]],
    "functions": [[]],
    "function_call": ["none"],
    "verbosity": ["medium"],
    "use_beam_search": [False],
    "length_penalty": [1.0],
    "spaces_between_special_tokens": [True],
}
# A sample value of each field accepted with no effect.
HARMLESS = {
    "user": "u-1",
    "metadata": {"k": "v"},
    "store": True,
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "implicit"},
    "prompt_cache_retention": "24h",
    "safety_identifier": "s-1",
    "prediction": {"type": "content", "content": "a guess"},
}


def _sdk_fields(module) -> set[str]:
    """Every key of the SDK's params TypedDicts (the streaming variants add ``stream``)."""
    names: set[str] = set()
    for typed_dict in (module.CompletionCreateParamsStreaming,
                       module.CompletionCreateParamsNonStreaming):
        names |= set(typing.get_type_hints(typed_dict))
    return names


SDK_FIELDS = {"chat": _sdk_fields(chat_params), "completions": _sdk_fields(completion_params)}


def _cases(statuses: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(endpoint, name) for endpoint in ("chat", "completions")
            for name in sorted(SDK_FIELDS[endpoint])
            if name in TABLES[endpoint] and TABLES[endpoint][name].status in statuses]


def _asking(endpoint: str, name: str):
    value = ASKING[name]
    return value[endpoint] if isinstance(value, dict) and endpoint in value else value


def _error_for(endpoint: str, body: dict):
    """The 400 the server answers to ``body`` (None: it validates)."""
    try:
        MODELS[endpoint].model_validate(body)
    except ValidationError as e:
        return _validation_error(RequestValidationError(e.errors()))
    return None


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_sdk_field_has_a_decision(endpoint):
    undecided = SDK_FIELDS[endpoint] - set(TABLES[endpoint])
    assert not undecided, f"decide each in request_fields.py: {sorted(undecided)}"
    assert {p.status for p in TABLES[endpoint].values()} <= {HONOURED, REJECTED, NO_EFFECT}


def test_the_sdk_lists_the_fields_we_expect():
    # The enumeration itself works (a broken one would pass every test above vacuously).
    assert {"messages", "tools", "logit_bias", "stream", "audio"} <= SDK_FIELDS["chat"]
    assert {"prompt", "suffix", "best_of", "echo", "stream"} <= SDK_FIELDS["completions"]


@pytest.mark.parametrize("endpoint, name", _cases((HONOURED,)))
def test_honoured_fields_are_declared_on_the_request_model(endpoint, name):
    assert name in MODELS[endpoint].model_fields


@pytest.mark.parametrize("endpoint, name", _cases((REJECTED,)))
def test_rejected_fields_are_a_400_naming_them(endpoint, name):
    err = _error_for(endpoint, {**BASE_BODIES[endpoint], name: _asking(endpoint, name)})
    assert err is not None and err.status == 400
    assert err.param == name
    assert err.message.startswith(f"{name}: ")
    for value in INERT.get(name, [None]):
        assert _error_for(endpoint, {**BASE_BODIES[endpoint], name: value}) is None


@pytest.mark.parametrize("endpoint, name", _cases((NO_EFFECT,)))
def test_harmless_fields_are_accepted(endpoint, name):
    assert _error_for(endpoint, {**BASE_BODIES[endpoint], name: HARMLESS[name]}) is None


@pytest.mark.parametrize("endpoint, name", [(e, n) for e in VLLM_TABLES for n in VLLM_TABLES[e]])
def test_unsupported_vllm_extras_are_a_400_naming_them(endpoint, name):
    assert name not in MODELS[endpoint].model_fields  # else the table contradicts the model
    err = _error_for(endpoint, {**BASE_BODIES[endpoint], name: _asking(endpoint, name)})
    assert err is not None and (err.status, err.param) == (400, name)
    for value in INERT.get(name, [None]):
        assert _error_for(endpoint, {**BASE_BODIES[endpoint], name: value}) is None


def test_default_add_special_tokens_is_accepted_on_each_endpoint():
    assert _error_for("chat", {"messages": MESSAGES, "add_special_tokens": False}) is None
    assert _error_for("completions", {"prompt": "x", "add_special_tokens": True}) is None


def test_best_of_equal_to_n_is_plain_sampling():
    assert _error_for("completions", {"prompt": "x", "n": 3, "best_of": 3}) is None
    err = _error_for("completions", {"prompt": "x", "n": 2, "best_of": 3})
    assert err.param == "best_of"


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "f"}},
])
def test_non_text_content_parts_are_a_400_naming_the_part(part):
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "see"}, part]}]}
    err = _error_for("chat", body)
    assert err.status == 400
    assert err.param == "messages[1].content[1].type"
    assert err.message == (f"messages[1].content[1].type: {part['type']!r} parts are not "
                           f"supported (the served models read text); send text parts")


def test_text_parts_still_validate():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    assert _error_for("chat", body) is None
