"""Hermes / Qwen tool calls: each call is a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and several may follow each other. Text before the first call is content; between and after
calls, text is content unless it is only whitespace. A block whose body is not such an
object stays content, tags included; an unclosed block at the end is a call if its body is
one (generation may stop right before the closing tag)."""

from __future__ import annotations

from widellm.entrypoints.tool_parsers.base import (
    ParsedOutput, ParsedToolCall, ToolParser, gap_content, held_marker_len, load_json,
    make_call,
)

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


def parse_hermes_call(body: str) -> ParsedToolCall | None:
    obj = load_json(body)
    if not isinstance(obj, dict):
        return None
    return make_call(obj.get("name"), obj.get("arguments", {}))


class HermesToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._num_calls = 0

    def _gap(self, out: ParsedOutput, text: str) -> None:
        out.content += gap_content(text) if self._num_calls else text

    def _block(self, out: ParsedOutput, body: str, raw: str) -> None:
        call = parse_hermes_call(body)
        if call is None:
            out.content += raw
        else:
            out.calls.append(call)
            self._num_calls += 1

    def _advance(self, final: bool) -> ParsedOutput:
        out, text = ParsedOutput(), self._text
        while True:
            start = text.find(CALL_START, self._pos)
            if start < 0:
                if final:
                    self._gap(out, text[self._pos:])
                    self._pos = len(text)
                elif not self._num_calls:
                    # Before any call, content streams at once, all but a possible tag start.
                    end = len(text) - held_marker_len(text[self._pos:], CALL_START)
                    out.content += text[self._pos:end]
                    self._pos = end
                # After a call, wait: the text may turn out to be only whitespace.
                return out
            self._gap(out, text[self._pos:start])
            self._pos = start
            body_start = start + len(CALL_START)
            end = text.find(CALL_END, body_start)
            if end < 0:
                if final:
                    self._block(out, text[body_start:], text[start:])
                    self._pos = len(text)
                return out
            self._block(out, text[body_start:end], text[start:end + len(CALL_END)])
            self._pos = end + len(CALL_END)
