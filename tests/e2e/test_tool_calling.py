"""Tool calling end to end: ``widellm serve --enable-auto-tool-choice --tool-call-parser
hermes`` on the tiny random model, driven by the official ``openai`` client.

Random weights write no tool calls of their own, so the constraint does all the work:
``required`` and named choices by the JSON schemas the server derives from the tools, and
the ``auto`` test by a regex (``structured_outputs``) that makes the model write one call in
the hermes format. Schemas are bounded (enums, integer ranges) so outputs finish well within
max_tokens. These tests need the structured-output engine (xgrammar in the engine core);
without it the random model writes unconstrained text and they fail.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server_harness import REQUEST_TIMEOUT_S, SERVED_NAME, start_server

TEST_TIMEOUT_S = 300
MAX_TOKENS = 200
SEED = 1234
GREEDY = {"temperature": 0.0, "seed": SEED}

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["timezone"],
    "additionalProperties": False,
}
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                           "parameters": params}}
         for name, params in PARAMS.items()]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

# One hermes call, exactly: what the auto test forces the model to write.
HERMES_CALL_REGEX = (r'<tool_call>\n\{"name": "get_weather", "arguments": '
                     r'\{"city": "Paris"\}\}\n</tool_call>')

# A template that writes tools, assistant tool calls (arguments with tojson: an object comes
# out as JSON, a string would come out quoted) and tool results. Newlines are expressions:
# HF renders with trim_blocks, which drops a newline written right after a block tag.
TOOL_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "call {{ c.id }} {{ c.function.name }}({{ c.function.arguments | tojson }})"
    "{% endfor %}"
    "{% elif m.role == 'tool' %}result {{ m.tool_call_id }}: {{ m.content }}"
    "{% else %}{{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TWO_TURNS = MESSAGES + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "18 C and sunny"},
]
TWO_TURNS_RENDERED = (
    "<|tools|>get_weather;get_time;\n"
    "<|user|>What is the weather in Paris?\n"
    '<|assistant|>call call_abc get_weather({"city": "Paris", "days": 2})\n'
    "<|tool|>result call_abc: 18 C and sunny\n"
    "<|assistant|>\n"
)

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from start_server(model_dir, tmp_path_factory, "tools", [
        "--served-model-name", SERVED_NAME, "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--trust-request-chat-template"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=REQUEST_TIMEOUT_S)


def _chat(client, **kwargs):
    return client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, tools=TOOLS,
                                          max_tokens=MAX_TOKENS, **GREEDY, **kwargs)


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


def _streamed_choices(client, **kwargs) -> list[tuple[str | None, list[tuple[str, str]], str]]:
    """Per choice: (content, [(name, arguments)], finish_reason) reassembled from a stream's
    deltas; checks each call's first delta carries its id and type."""
    contents, calls, finishes = {}, {}, {}
    for chunk in _chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta, i = choice.delta, choice.index
            if delta.content:
                contents[i] = contents.get(i, "") + delta.content
            for call in delta.tool_calls or []:
                if call.index not in calls.setdefault(i, {}):
                    assert call.id.startswith("call_") and call.type == "function"
                    calls[i][call.index] = [call.function.name, ""]
                calls[i][call.index][1] += call.function.arguments or ""
            finishes[i] = choice.finish_reason or finishes.get(i)
    return [(contents.get(i), [tuple(c) for _, c in sorted(calls.get(i, {}).items())],
             finishes[i]) for i in sorted(finishes)]


def _streamed(client, **kwargs) -> tuple[str | None, list[tuple[str, str]], str]:
    (choice,) = _streamed_choices(client, **kwargs)
    return choice


def _check_arguments(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMS[name])


# ---- required and named: the schema enforces the calls (needs the structured-output engine) --

def test_required_returns_calls_that_validate(client):
    choice = _chat(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    _check_arguments(call.function.name, call.function.arguments)


def test_named_function_returns_its_call(client):
    choice = _chat(client, tool_choice=NAMED).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _check_arguments("get_weather", call.function.arguments)


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_streamed_deltas_reassemble_to_the_call(client, tool_choice):
    choice = _chat(client, tool_choice=tool_choice, parallel_tool_calls=False).choices[0]
    assert _streamed(client, tool_choice=tool_choice, parallel_tool_calls=False) == (
        None, _calls(choice.message), "tool_calls")


def test_each_of_n_choices_streams_its_own_calls(client):
    response = _chat(client, tool_choice=NAMED, n=2)
    expected = [(None, _calls(c.message), "tool_calls") for c in response.choices]
    assert _streamed_choices(client, tool_choice=NAMED, n=2) == expected


# ---- auto: the hermes parser finds the call the model wrote ----------------------------------

def test_auto_parses_a_hermes_call(client):
    forced = {"structured_outputs": {"regex": HERMES_CALL_REGEX}}
    choice = _chat(client, extra_body=forced).choices[0]
    expected = [("get_weather", '{"city": "Paris"}')]
    assert (choice.message.content, _calls(choice.message), choice.finish_reason) == (
        None, expected, "tool_calls")
    assert _streamed(client, extra_body=forced) == (None, expected, "tool_calls")


# ---- conversations with tool results, and refusals ------------------------------------------

def _tokenize(server, **body) -> list[int]:
    response = httpx.post(server.url + "/tokenize", json={"model": SERVED_NAME, **body},
                          timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_two_turn_exchange_renders_the_call_and_its_result(server, client):
    ids = _tokenize(server, messages=TWO_TURNS, tools=TOOLS, chat_template=TOOL_TEMPLATE)
    text = httpx.post(server.url + "/detokenize", json={"model": SERVED_NAME, "tokens": ids},
                      timeout=REQUEST_TIMEOUT_S).json()["prompt"]
    assert text == TWO_TURNS_RENDERED
    # The chat endpoint renders the same prompt (and so does the model's own template).
    for template in ({"chat_template": TOOL_TEMPLATE}, {}):
        response = client.chat.completions.create(
            model=SERVED_NAME, messages=TWO_TURNS, tools=TOOLS, tool_choice="none",
            max_tokens=1, extra_body=template, **GREEDY)
        expected_ids = _tokenize(server, messages=TWO_TURNS, tools=TOOLS, **template)
        assert response.usage.prompt_tokens == len(expected_ids)
        assert response.choices[0].message.tool_calls is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice: names the function 'nope', which is not in tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice: required tool calls are generated with a JSON schema and cannot be "
     "combined with response_format or structured_outputs"),
])
def test_conflicting_tool_choice_is_a_400(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, **kwargs)
    error = info.value.body
    assert (error["param"], error["message"]) == ("tool_choice", message)
