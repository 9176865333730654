"""Tool calling without a server: the request fields and their 400s, the schemas required and
named choices generate by, outputs turned into messages and stream deltas, and the shapes
the responses serialize to."""

from __future__ import annotations

import json
from http import HTTPStatus

import jsonschema
import pytest
import xgrammar as xgr
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from widellm.entrypoints.api_server import _validation_error
from widellm.entrypoints.cli import build_parser
from widellm.entrypoints.errors import APIError
from widellm.entrypoints.protocol_chat import (
    ChatCompletionMessage, ChatCompletionRequest, ChatMessage, DeltaMessage,
)
from widellm.entrypoints.server_args import check_server_args
from widellm.entrypoints.tool_calls import (
    AUTO, NAMED, NO_PARAMETERS_SCHEMA, REQUIRED, ToolCallPlan, named_schema,
    parse_required_calls, required_schema, tool_finish_reason,
)
from widellm.entrypoints.tool_parsers import TOOL_PARSERS, ParsedToolCall
from widellm.sampling_params import SamplingParams, StructuredOutputsParams

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
HERMES = TOOL_PARSERS["hermes"]
HERMES_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
               '\n</tool_call>')


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


def _plan(enable_auto: bool = True, **fields) -> ToolCallPlan | None:
    return ToolCallPlan.for_request(_request(**fields), enable_auto, HERMES)


def _dump(deltas: list[DeltaMessage]) -> list[dict]:
    return [d.model_dump() for d in deltas]


# ---- request validation ------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "message"), [
    ({"tool_choice": "required"}, "tool_choice: requires tools (none were given)"),
    ({"tool_choice": "auto", "tools": []}, "tool_choice: requires tools (none were given)"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice: names the function 'nope', which is not in tools"),
])
def test_bad_tool_choice_is_a_400_naming_it(fields, message):
    with pytest.raises(ValidationError) as info:
        _request(**fields)
    err = _validation_error(RequestValidationError(info.value.errors()))
    assert (err.status, err.param, err.message) == (HTTPStatus.BAD_REQUEST, "tool_choice",
                                                    message)


def test_tool_choice_none_without_tools_is_accepted():
    assert _request(tool_choice="none").tool_choice == "none"


def test_default_choice_is_auto_only_where_the_server_enables_it():
    assert _plan(tools=TOOLS).mode == AUTO
    assert _plan(enable_auto=False, tools=TOOLS) is None
    assert _plan(tools=TOOLS, tool_choice="none") is None
    assert _plan() is None  # no tools


def test_explicit_auto_without_the_server_flag_is_a_400():
    with pytest.raises(APIError) as info:
        _plan(enable_auto=False, tools=TOOLS, tool_choice="auto")
    assert (info.value.status, info.value.param) == (HTTPStatus.BAD_REQUEST, "tool_choice")
    assert info.value.message == ('tool_choice: "auto" requires the server to be started with '
                                  '--enable-auto-tool-choice and --tool-call-parser')


def test_required_and_named_need_no_server_flag():
    assert _plan(enable_auto=False, tools=TOOLS, tool_choice="required").mode == REQUIRED
    plan = _plan(enable_auto=False, tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (plan.mode, plan.function_name) == (NAMED, "get_time")


def test_auto_tool_choice_needs_a_parser_at_start_up():
    def serve_args(*flags: str):
        return build_parser().parse_args(["serve", *flags])

    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        check_server_args(serve_args("--enable-auto-tool-choice"))
    check_server_args(serve_args("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))


# ---- schemas -------------------------------------------------------------------------------

def _call_schema(name: str, parameters: dict) -> dict:
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False}


def test_required_schema():
    tools = _request(tools=TOOLS).tools
    items = {"anyOf": [_call_schema("get_weather", WEATHER_PARAMS),
                       _call_schema("get_time", NO_PARAMETERS_SCHEMA)]}
    assert required_schema(tools, parallel=True) == {"type": "array", "items": items,
                                                     "minItems": 1}
    assert required_schema(tools, parallel=False) == {"type": "array", "items": items,
                                                      "minItems": 1, "maxItems": 1}


def test_named_schema_is_the_functions_parameters():
    tools = _request(tools=TOOLS).tools
    assert named_schema(tools, "get_weather") == WEATHER_PARAMS
    assert named_schema(tools, "get_time") == NO_PARAMETERS_SCHEMA


@pytest.mark.parametrize(("parallel", "output", "valid"), [
    (True, [{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}},
            {"name": "get_time", "parameters": {}}], True),
    (False, [{"name": "get_time", "parameters": {}}], True),
    (False, [{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}],
     False),
    (True, [], False),
    (True, [{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}], False),
    (True, [{"name": "get_time", "parameters": {"city": "Lima"}}], False),
])
def test_required_schema_accepts_calls_only_and_compiles(parallel, output, valid):
    schema = required_schema(_request(tools=TOOLS).tools, parallel)
    assert jsonschema.Draft202012Validator(schema).is_valid(output) == valid
    xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)  # no error


def test_constrain_sets_a_compact_json_schema():
    params = SamplingParams()
    _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}
          ).constrain(params)
    assert params.structured_outputs == StructuredOutputsParams(json=WEATHER_PARAMS,
                                                                disable_any_whitespace=True)
    params = SamplingParams()
    _plan(tools=TOOLS).constrain(params)  # auto: unconstrained
    assert params.structured_outputs is None


def test_constrain_refuses_a_request_with_its_own_structured_output():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(APIError) as info:
        _plan(tools=TOOLS, tool_choice="required").constrain(params)
    assert (info.value.status, info.value.param) == (HTTPStatus.BAD_REQUEST, "tool_choice")


# ---- outputs -------------------------------------------------------------------------------

def test_parse_required_calls():
    text = ('[{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}, '
            '{"name": "get_time", "parameters": {}}]')
    both = [ParsedToolCall("get_weather", '{"city": "Lima", "days": 2}'),
            ParsedToolCall("get_time", "{}")]
    assert parse_required_calls(text, parallel=True) == both
    assert parse_required_calls(text, parallel=False) == both[:1]
    assert parse_required_calls(text[:-1], parallel=True) is None  # cut off
    assert parse_required_calls('[{"name": "get_time"}]', parallel=True) is None
    assert parse_required_calls("[]", parallel=True) is None


def _message_dump(message: ChatCompletionMessage) -> dict:
    data = message.model_dump()
    for call in data.get("tool_calls") or []:
        assert call.pop("id").startswith("call_")
    return data


def test_messages_of_each_mode():
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    assert _message_dump(named.message("{}")) == {"role": "assistant", "content": None,
                                                  "tool_calls": [call]}
    required = _plan(tools=TOOLS, tool_choice="required")
    assert _message_dump(required.message('[{"name": "get_time", "parameters": {}}]')) == {
        "role": "assistant", "content": None, "tool_calls": [call]}
    assert _message_dump(required.message("[{")) == {"role": "assistant", "content": "[{"}
    auto = _plan(tools=TOOLS)
    weather = {"type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
    assert _message_dump(auto.message("Sure. " + HERMES_CALL)) == {
        "role": "assistant", "content": "Sure. ", "tool_calls": [weather]}
    assert _message_dump(auto.message("No call.")) == {"role": "assistant",
                                                       "content": "No call."}


def test_auto_without_parallel_calls_keeps_the_first():
    plan = _plan(tools=TOOLS, parallel_tool_calls=False)
    message = plan.message(HERMES_CALL + HERMES_CALL)
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    stream = plan.stream()
    deltas = stream.feed(HERMES_CALL) + stream.feed(HERMES_CALL) + stream.finish()
    assert [[c.index for c in d.tool_calls] for d in deltas] == [[0]]


def test_finish_reason():
    assert tool_finish_reason("stop", made_calls=True) == "tool_calls"
    assert tool_finish_reason("length", made_calls=True) == "length"
    assert tool_finish_reason("stop", made_calls=False) == "stop"


def _without_ids(deltas: list[dict]) -> list[dict]:
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call.pop("id").startswith("call_")
    return deltas


def test_named_stream_sends_the_name_then_argument_text():
    stream = _plan(tools=TOOLS, tool_choice={"type": "function",
                                             "function": {"name": "get_weather"}}).stream()
    deltas = _dump(stream.feed('{"city"') + stream.feed(': "Lima"}') + stream.finish())
    assert _without_ids(deltas) == [
        {"tool_calls": [{"index": 0, "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "Lima"}'}}]},
    ]
    assert stream.made_calls


def test_required_stream_sends_the_calls_at_the_end():
    stream = _plan(tools=TOOLS, tool_choice="required").stream()
    assert stream.feed('[{"name": "get_time", ') == []
    deltas = _dump(stream.feed('"parameters": {}}]') + stream.finish())
    assert _without_ids(deltas) == [{"tool_calls": [{
        "index": 0, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]


def test_auto_stream_sends_content_then_each_call():
    stream = _plan(tools=TOOLS).stream()
    deltas = _dump(stream.feed("Sure. <tool") + stream.feed(HERMES_CALL[5:] + HERMES_CALL)
                   + stream.finish())
    weather = {"type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
    assert _without_ids(deltas) == [
        {"content": "Sure. "},
        {"tool_calls": [{"index": 0, **weather}, {"index": 1, **weather}]},
    ]
    assert not _plan(tools=TOOLS).stream().made_calls


# ---- shapes --------------------------------------------------------------------------------

def test_plain_message_keeps_its_shape():
    assert ChatCompletionMessage(content="hi").model_dump() == {"role": "assistant",
                                                               "content": "hi"}


def test_tool_messages_reach_the_template_with_object_arguments():
    assistant = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": "not json"}}])
    assert assistant.to_template_dict() == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": "not json"}}]}
    tool = ChatMessage(role="tool", content="18 C", tool_call_id="call_1")
    assert tool.to_template_dict() == {"role": "tool", "content": "18 C",
                                       "tool_call_id": "call_1"}
