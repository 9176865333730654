"""OpenAI's tool-calling shapes (pydantic v2): the ``tools`` a chat request offers, its
``tool_choice``, the ``tool_calls`` of assistant messages (sent back in later turns and
returned in responses) and the tool-call deltas of a stream."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field, model_serializer

from widellm.entrypoints.protocol import OpenAIBaseModel
from widellm.entrypoints.tool_parsers.base import load_json

# OpenAI's tool-call ids look like "call_" and 24 alphanumerics; clients only echo them back.
TOOL_CALL_ID_PREFIX = "call_"
TOOL_CALL_ID_HEX_CHARS = 24
FUNCTION = "function"


def make_tool_call_id() -> str:
    return TOOL_CALL_ID_PREFIX + uuid.uuid4().hex[:TOOL_CALL_ID_HEX_CHARS]


def _drop_none(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v is not None}


# ---- requests ------------------------------------------------------------------------------

class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    # A JSON schema of the arguments object; None: the function takes no arguments.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = FUNCTION
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"] = FUNCTION
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tool_choice(tools: list[ChatCompletionTool] | None,
                      tool_choice: ToolChoice | None) -> None:
    """A choice other than "none" needs tools, and a named choice one of them (ValueError
    naming ``tool_choice``); what the server allows (``auto``) is checked when serving."""
    if tool_choice is None or tool_choice == "none":
        return
    if not tools:
        raise ValueError("tool_choice: requires tools (none were given)")
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in {tool.function.name for tool in tools}:
            raise ValueError(f"tool_choice: names the function {name!r}, which is not in "
                             f"tools")


# ---- in messages and responses ---------------------------------------------------------------

class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = FUNCTION
    function: FunctionCall

    def to_template_dict(self) -> dict[str, Any]:
        """The call as chat templates read it: arguments as an object where the text is
        one (templates write them with ``tojson``), else the text as sent."""
        arguments = load_json(self.function.arguments)
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": self.type,
                "function": {"name": self.function.name, "arguments": arguments}}


# ---- streaming -------------------------------------------------------------------------------

class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        # Only the first delta of a call names the function; later ones carry argument text.
        return _drop_none(handler(self))


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        # id and type come with a call's first delta only, as in OpenAI's streams.
        return _drop_none(handler(self))
