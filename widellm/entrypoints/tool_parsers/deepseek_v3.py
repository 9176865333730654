"""DeepSeek-V3 tool calls: one section of calls after the content, each call naming its
function and giving its arguments as a fenced JSON block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Text before the section is content; inside and after it, text outside calls is content
unless it is only whitespace. A call block that is not of this form stays content, markers
included; an unclosed block at the end is a call if it is complete otherwise."""

from __future__ import annotations

import re

from widellm.entrypoints.tool_parsers.base import (
    ParsedOutput, ParsedToolCall, ToolParser, gap_content, held_marker_len, load_json,
    make_call,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
CALL_SEP = "<｜tool▁sep｜>"
CALL_BODY = re.compile(
    r"\s*function" + re.escape(CALL_SEP) + r"(?P<name>[^\n]+?)\s*\n"
    r"```(?:json)?[ \t]*\n(?P<arguments>.*?)\n?```\s*", re.DOTALL)

# Where the parser is in the output.
BEFORE_CALLS, IN_CALLS, AFTER_CALLS = range(3)


def parse_deepseek_v3_call(body: str) -> ParsedToolCall | None:
    match = CALL_BODY.fullmatch(body)
    if match is None:
        return None
    return make_call(match.group("name"), load_json(match.group("arguments")))


def _first(text: str, pos: int, *markers: str) -> tuple[int, str | None]:
    """Where the earliest of ``markers`` starts in ``text[pos:]``, and which it is."""
    found = [(i, m) for m in markers if (i := text.find(m, pos)) >= 0]
    return min(found) if found else (-1, None)


class DeepSeekV3ToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._where = BEFORE_CALLS

    def _before(self, out: ParsedOutput, final: bool) -> bool:
        """Content up to the section; True once inside it."""
        text = self._text
        begin = text.find(CALLS_BEGIN, self._pos)
        if begin < 0:
            held = 0 if final else held_marker_len(text[self._pos:], CALLS_BEGIN)
            out.content += text[self._pos:len(text) - held]
            self._pos = len(text) - held
            return False
        out.content += text[self._pos:begin]
        self._pos = begin + len(CALLS_BEGIN)
        self._where = IN_CALLS
        return True

    def _in_calls(self, out: ParsedOutput, final: bool) -> bool:
        """One call, or the section's end; True if there may be more to settle."""
        text = self._text
        at, marker = _first(text, self._pos, CALL_BEGIN, CALLS_END)
        if marker is None:
            if final:
                out.content += gap_content(text[self._pos:])
                self._pos = len(text)
            return False
        out.content += gap_content(text[self._pos:at])
        self._pos = at
        if marker == CALLS_END:
            self._pos = at + len(CALLS_END)
            self._where = AFTER_CALLS
            return True
        body_start = at + len(CALL_BEGIN)
        end = text.find(CALL_END, body_start)
        if end < 0 and not final:
            return False
        end_of_block = len(text) if end < 0 else end + len(CALL_END)
        call = parse_deepseek_v3_call(text[body_start:len(text) if end < 0 else end])
        if call is None:
            out.content += text[at:end_of_block]
        else:
            out.calls.append(call)
        self._pos = end_of_block
        return end >= 0

    def _advance(self, final: bool) -> ParsedOutput:
        out = ParsedOutput()
        if self._where == BEFORE_CALLS and not self._before(out, final):
            return out
        while self._where == IN_CALLS:
            if not self._in_calls(out, final):
                return out
        if final:  # after the section: wait for the end, it may be only whitespace
            out.content += gap_content(self._text[self._pos:])
            self._pos = len(self._text)
        return out
