"""What every tool-call parser shares: the parsed shapes, the streaming contract and the
JSON helpers.

A parser reads one model output and splits it into content (text for the user) and tool
calls. It does so incrementally: ``feed`` takes each new piece of text and reports only what
is already settled, i.e. what no later text can change; ``finish`` settles the rest. So the
pieces a stream reports always add up to what one ``extract`` of the whole text returns,
however the text was split. Text that looks like a call but is not a well-formed one stays
content: a parser never fails a request.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass(slots=True)
class ParsedOutput:
    """Content and complete tool calls, of a whole output or of one streamed step."""

    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)

    def extend(self, other: ParsedOutput) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


class ToolParser(ABC):
    """Parses one output; make one instance per output (a stream's state lives in it)."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # self._text[:self._pos] has been reported

    @abstractmethod
    def _advance(self, final: bool) -> ParsedOutput:
        """Report what is settled in ``self._text[self._pos:]`` and move ``self._pos`` past
        it; ``final``: the text is complete, settle all of it."""

    def feed(self, delta: str) -> ParsedOutput:
        """Content and calls that ``delta`` settled (possibly nothing yet)."""
        self._text += delta
        return self._advance(final=False)

    def finish(self) -> ParsedOutput:
        """Everything still held back, at the end of the output."""
        return self._advance(final=True)

    @classmethod
    def extract(cls, text: str) -> ParsedOutput:
        """Content and calls of a whole output."""
        parser = cls()
        out = parser.feed(text)
        out.extend(parser.finish())
        return out


def _reject_constant(name: str) -> Any:
    # json accepts NaN and Infinity, which are not JSON and could not be sent on as arguments.
    raise ValueError(f"{name} is not JSON")


JSON_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def load_json(text: str) -> Any | None:
    """The JSON value ``text`` holds (surrounding whitespace allowed), or None if it is not
    one."""
    text = text.strip()
    try:
        value, end = JSON_DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        return None
    return value if end == len(text) else None


def make_call(name: Any, arguments: Any) -> ParsedToolCall | None:
    """A call if ``name`` is a function name and ``arguments`` an arguments object."""
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


def held_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``: that
    much must wait for more text before it can be reported as content."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def gap_content(text: str) -> str:
    """Text between or after tool calls: content unless it is only whitespace (models put
    newlines between calls)."""
    return text if text.strip() else ""
