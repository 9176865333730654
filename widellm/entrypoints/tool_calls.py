"""Tool calling for one chat request: what ``tool_choice`` makes of it, and its outputs turned
into ``tool_calls``.

- ``required`` and a named function constrain generation with a JSON schema (the structured
  output engine): for ``required`` an array of ``{"name", "parameters"}`` objects, one per
  call, for a named function its arguments object itself.
- ``auto`` lets the model write freely and finds calls in its output with the server's
  ``--tool-call-parser``; that needs ``--enable-auto-tool-choice``, as in vLLM.
- ``none`` (or no tools): a plain chat completion; the tools still reach the chat template.

A choice that returns calls and stopped on its own ends with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from widellm.entrypoints.errors import APIError
from widellm.entrypoints.protocol_chat import (
    ASSISTANT_ROLE,
    ChatCompletionMessage, ChatCompletionRequest, DeltaMessage,
)
from widellm.entrypoints.protocol_tools import (
    FUNCTION, ChatCompletionTool, DeltaFunctionCall, DeltaToolCall, FunctionCall,
    NamedToolChoice, ToolCall, make_tool_call_id,
)
from widellm.entrypoints.tool_parsers.base import (
    ParsedOutput, ParsedToolCall, ToolParser, load_json, make_call,
)
from widellm.sampling_params import SamplingParams, StructuredOutputsParams

AUTO, NONE, REQUIRED, NAMED = "auto", "none", "required", "named"
FINISH_STOP = "stop"
FINISH_TOOL_CALLS = "tool_calls"
# The arguments of a function that declares no parameters: an object without fields.
NO_PARAMETERS_SCHEMA: dict[str, Any] = {"type": "object", "properties": {},
                                        "additionalProperties": False}
# Keys of one element of the array a ``required`` choice generates.
REQUIRED_NAME_KEY = "name"
REQUIRED_ARGUMENTS_KEY = "parameters"


def _parameters(tool: ChatCompletionTool) -> dict[str, Any]:
    return tool.function.parameters or NO_PARAMETERS_SCHEMA


def required_schema(tools: list[ChatCompletionTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a ``required`` choice's output: at least one call (exactly one
    without parallel tool calls), each naming a tool and matching its parameters."""
    calls = [{
        "type": "object",
        "properties": {REQUIRED_NAME_KEY: {"type": "string", "enum": [tool.function.name]},
                       REQUIRED_ARGUMENTS_KEY: _parameters(tool)},
        "required": [REQUIRED_NAME_KEY, REQUIRED_ARGUMENTS_KEY],
        "additionalProperties": False,
    } for tool in tools]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: list[ChatCompletionTool], name: str) -> dict[str, Any]:
    """The JSON schema of a named choice's output: that function's arguments."""
    return next(_parameters(t) for t in tools if t.function.name == name)


def parse_required_calls(text: str, parallel: bool) -> list[ParsedToolCall] | None:
    """The calls of a ``required`` output, or None if it is not an array of calls (cut off
    by max_tokens, or generated without the constraint)."""
    value = load_json(text)
    if not isinstance(value, list) or not value:
        return None
    calls = [make_call(item.get(REQUIRED_NAME_KEY), item.get(REQUIRED_ARGUMENTS_KEY))
             if isinstance(item, dict) else None for item in value]
    if None in calls:
        return None
    return calls if parallel else calls[:1]


def tool_finish_reason(finish_reason: str | None, made_calls: bool) -> str | None:
    """"tool_calls" for a choice that returned calls and stopped by itself; a choice cut off
    by max_tokens keeps "length"."""
    return FINISH_TOOL_CALLS if made_calls and finish_reason == FINISH_STOP else finish_reason


def _first_delta(index: int, call_id: str, name: str, arguments: str) -> DeltaToolCall:
    return DeltaToolCall(index=index, id=call_id, type=FUNCTION,
                         function=DeltaFunctionCall(name=name, arguments=arguments))


@dataclass(frozen=True, slots=True)
class ToolCallPlan:
    """How one request's outputs become tool calls (built only when it may make some)."""

    mode: str  # AUTO, REQUIRED or NAMED
    tools: list[ChatCompletionTool]
    parallel: bool
    function_name: str | None = None  # the NAMED function
    parser: type[ToolParser] | None = None  # AUTO's

    @classmethod
    def for_request(cls, request: ChatCompletionRequest, enable_auto_tool_choice: bool,
                    parser: type[ToolParser] | None) -> ToolCallPlan | None:
        """None for ``none``. A request with tools and no tool_choice gets ``auto`` where
        the server enables it, ``none`` elsewhere; an explicit ``auto`` there is a 400."""
        if not request.tools:
            return None
        auto_allowed = enable_auto_tool_choice and parser is not None
        choice = request.tool_choice
        if choice is None:
            choice = AUTO if auto_allowed else NONE
        if choice == NONE:
            return None
        common = dict(tools=request.tools, parallel=request.parallel_tool_calls)
        if isinstance(choice, NamedToolChoice):
            return cls(NAMED, function_name=choice.function.name, **common)
        if choice == REQUIRED:
            return cls(REQUIRED, **common)
        if not auto_allowed:
            raise APIError('tool_choice: "auto" requires the server to be started with '
                           '--enable-auto-tool-choice and --tool-call-parser',
                           HTTPStatus.BAD_REQUEST, "tool_choice")
        return cls(AUTO, parser=parser, **common)

    @property
    def constrains(self) -> bool:
        """Whether generation follows a schema (``required`` and named choices)."""
        return self.mode != AUTO

    def constrain(self, params: SamplingParams) -> None:
        """Set the schema ``required`` and named choices generate by; a request that brings
        its own structured output cannot have both (400)."""
        if not self.constrains:
            return
        if params.structured_outputs is not None:
            raise APIError(f"tool_choice: {self.mode} tool calls are generated with a JSON "
                           f"schema and cannot be combined with response_format or "
                           f"structured_outputs", HTTPStatus.BAD_REQUEST, "tool_choice")
        schema = (named_schema(self.tools, self.function_name) if self.mode == NAMED
                  else required_schema(self.tools, self.parallel))
        # Compact JSON (", " and ": " only): free whitespace lets a model spend its whole
        # budget on blanks, and tool arguments need none.
        params.structured_outputs = StructuredOutputsParams(json=schema,
                                                            disable_any_whitespace=True)

    def parse(self, text: str) -> ParsedOutput:
        """Content and calls of a whole output."""
        if self.mode == NAMED:
            return ParsedOutput(calls=[ParsedToolCall(self.function_name, text)])
        if self.mode == REQUIRED:
            calls = parse_required_calls(text, self.parallel)
            return ParsedOutput(text) if calls is None else ParsedOutput(calls=calls)
        out = self.parser.extract(text)
        if not self.parallel:
            del out.calls[1:]
        return out

    def message(self, text: str) -> ChatCompletionMessage:
        """The assistant message of a whole output: content, or calls (and any content)."""
        parsed = self.parse(text)
        if not parsed.calls:
            return ChatCompletionMessage(role=ASSISTANT_ROLE, content=parsed.content)
        calls = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.calls]
        return ChatCompletionMessage(role=ASSISTANT_ROLE, content=parsed.content or None,
                                     tool_calls=calls)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """One streamed choice's deltas: a named call's arguments as they are generated; for
    ``auto``, content as soon as the parser settles it and each call once it is complete;
    for ``required``, the calls at the end (the array is only known to be well formed
    then)."""

    def __init__(self, plan: ToolCallPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._text: list[str] = []  # REQUIRED's output so far
        self._parser = plan.parser() if plan.mode == AUTO else None

    @property
    def made_calls(self) -> bool:
        return self.num_calls > 0

    def _named_start(self) -> list[DeltaMessage]:
        if self.num_calls:
            return []
        self.num_calls = 1
        return [DeltaMessage(tool_calls=[
            _first_delta(0, make_tool_call_id(), self.plan.function_name, "")])]

    def _parsed(self, parsed: ParsedOutput) -> list[DeltaMessage]:
        calls = parsed.calls if self.plan.parallel else parsed.calls[:max(0, 1 - self.num_calls)]
        deltas = []
        for call in calls:
            deltas.append(_first_delta(self.num_calls, make_tool_call_id(), call.name,
                                       call.arguments))
            self.num_calls += 1
        if not parsed.content and not deltas:
            return []
        return [DeltaMessage(content=parsed.content or None, tool_calls=deltas or None)]

    def feed(self, text: str) -> list[DeltaMessage]:
        """Deltas for a choice's new text (possibly none yet)."""
        if self.plan.mode == NAMED:
            start = self._named_start()
            if not text:
                return start
            return start + [DeltaMessage(tool_calls=[DeltaToolCall(
                index=0, function=DeltaFunctionCall(arguments=text))])]
        if self.plan.mode == REQUIRED:
            self._text.append(text)
            return []
        return self._parsed(self._parser.feed(text))

    def finish(self) -> list[DeltaMessage]:
        """Deltas for what the choice held back, once it has finished."""
        if self.plan.mode == NAMED:
            return self._named_start()
        if self.plan.mode == REQUIRED:
            return self._parsed(self.plan.parse("".join(self._text)))
        return self._parsed(self._parser.finish())
