"""Llama 3.1+ JSON tool calls: the whole output is one call object, or several separated by
semicolons, optionally after ``<|python_tag|>``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

(``arguments`` is accepted for ``parameters``.) The output is all calls or all content: an
output that starts like a call but is not a list of well-formed ones is returned as content,
whole. So once an output starts with ``{`` or the tag, a stream holds it to the end."""

from __future__ import annotations

from widellm.entrypoints.tool_parsers.base import (
    JSON_DECODER, ParsedOutput, ParsedToolCall, ToolParser, make_call,
)

PYTHON_TAG = "<|python_tag|>"
CALL_SEPARATOR = ";"
ARGUMENT_KEYS = ("parameters", "arguments")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _parse_object(obj: object) -> ParsedToolCall | None:
    if not isinstance(obj, dict):
        return None
    key = next((k for k in ARGUMENT_KEYS if k in obj), None)
    return None if key is None else make_call(obj.get("name"), obj[key])


def parse_llama3_calls(text: str) -> list[ParsedToolCall] | None:
    """The calls of a whole output, or None if it is not made of calls only."""
    text = text.strip().removeprefix(PYTHON_TAG)
    calls, pos = [], _skip_space(text, 0)
    while True:
        try:
            obj, pos = JSON_DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        call = _parse_object(obj)
        if call is None:
            return None
        calls.append(call)
        pos = _skip_space(text, pos)
        if pos == len(text):
            return calls
        if text[pos] != CALL_SEPARATOR:
            return None
        pos = _skip_space(text, pos + 1)


class Llama3JsonToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._is_content: bool | None = None  # None: undecided yet

    def _decide(self, final: bool) -> None:
        head = self._text.lstrip()
        if not final and PYTHON_TAG.startswith(head):  # nothing yet, or the tag in part
            return
        self._is_content = not (head.startswith(PYTHON_TAG) or head.startswith("{"))

    def _advance(self, final: bool) -> ParsedOutput:
        if self._is_content is None:
            self._decide(final)
        out = ParsedOutput()
        if self._is_content:
            out.content, self._pos = self._text[self._pos:], len(self._text)
        elif final:  # decided by now
            calls = parse_llama3_calls(self._text)
            if calls is None:
                out.content = self._text
            else:
                out.calls = calls
            self._pos = len(self._text)
        return out
