"""Tool-call parsers: exact content and calls for each format's outputs, and the streaming
contract: however an output is split, what ``feed``/``finish`` report adds up to exactly
what ``extract`` returns, and content before a call streams before the output ends."""

from __future__ import annotations

import random

import pytest

from widellm.entrypoints.tool_parsers import TOOL_PARSERS, ParsedOutput, ParsedToolCall
from widellm.entrypoints.tool_parsers.base import held_marker_len
from widellm.entrypoints.tool_parsers.deepseek_v3 import (
    CALL_BEGIN, CALL_END, CALL_SEP, CALLS_BEGIN, CALLS_END,
)

RANDOM_SPLIT_SEEDS = range(20)
MAX_RANDOM_CHUNK = 7

WEATHER = ParsedToolCall("get_weather", '{"city": "Paris", "days": 3}')
TIME = ParsedToolCall("get_time", '{"timezone": "CET"}')


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _deepseek(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{CALL_SEP}{name}\n```json\n{args}\n```{CALL_END}"


HERMES_WEATHER = _hermes("get_weather", '{"city": "Paris", "days": 3}')
HERMES_TIME = _hermes("get_time", '{"timezone": "CET"}')
DS_WEATHER = _deepseek("get_weather", '{"city": "Paris", "days": 3}')
DS_TIME = _deepseek("get_time", '{"timezone": "CET"}')

# (parser, output, expected content, expected calls)
CASES = [
    # hermes / Qwen
    ("hermes", "Paris is sunny.", "Paris is sunny.", []),
    ("hermes", HERMES_WEATHER, "", [WEATHER]),
    ("hermes", f"Let me check.\n{HERMES_WEATHER}\n{HERMES_TIME}", "Let me check.\n",
     [WEATHER, TIME]),
    ("hermes", f"{HERMES_WEATHER}\nDone.", "\nDone.", [WEATHER]),
    ("hermes", f"{HERMES_WEATHER}\n  \n", "", [WEATHER]),
    # No arguments key: a call without arguments.
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', "",
     [ParsedToolCall("get_time", "{}")]),
    # Non-ASCII arguments stay as they are.
    ("hermes", _hermes("get_weather", '{"city": "Zürich"}'), "",
     [ParsedToolCall("get_weather", '{"city": "Zürich"}')]),
    # Generation stopped before the closing tag: still a call.
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n', "",
     [TIME]),
    # Malformed blocks stay content, tags included.
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', []),
    ("hermes", f'{HERMES_WEATHER}<tool_call>{{"name": 7}}</tool_call>',
     '<tool_call>{"name": 7}</tool_call>', [WEATHER]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}',
     '<tool_call>{"name": "f", "arguments": [1]}', []),
    ("hermes", "Almost a tag: <tool_ca", "Almost a tag: <tool_ca", []),
    # llama3_json
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "",
     [WEATHER]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"days": 3}}; {"name": "get_time", "parameters": {"timezone": "CET"}}', "",
     [WEATHER, TIME]),
    ("llama3_json", ' \n{"name": "get_time", "arguments": {"timezone": "CET"}} ', "", [TIME]),
    # All or nothing: anything but calls makes the whole output content.
    ("llama3_json", '{"name": "get_time"}', '{"name": "get_time"}', []),
    ("llama3_json", '{"name": "get_time", "parameters": {}} and more',
     '{"name": "get_time", "parameters": {}} and more', []),
    ("llama3_json", '{"name": "get_time", "parameters": {}}; oops',
     '{"name": "get_time", "parameters": {}}; oops', []),
    ("llama3_json", '{"name": "get_time", "parameters": {"a": 1',
     '{"name": "get_time", "parameters": {"a": 1', []),
    ("llama3_json", "<|pyramid", "<|pyramid", []),
    ("llama3_json", "  ", "  ", []),
    # deepseek_v3
    ("deepseek_v3", "Paris is sunny.", "Paris is sunny.", []),
    ("deepseek_v3", f"Checking.{CALLS_BEGIN}{DS_WEATHER}{CALLS_END}", "Checking.", [WEATHER]),
    ("deepseek_v3", f"{CALLS_BEGIN}{DS_WEATHER}\n{DS_TIME}{CALLS_END}", "", [WEATHER, TIME]),
    ("deepseek_v3", f"{CALLS_BEGIN}{DS_WEATHER}{CALLS_END}\nDone.", "\nDone.", [WEATHER]),
    # Stopped before the end markers: the complete block is a call.
    ("deepseek_v3", f"{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}get_time\n```json\n"
                    f'{{"timezone": "CET"}}\n```', "", [TIME]),
    # A malformed block stays content, markers included.
    ("deepseek_v3", f"{CALLS_BEGIN}{_deepseek('get_time', '{bad}')}{DS_WEATHER}{CALLS_END}",
     _deepseek("get_time", "{bad}"), [WEATHER]),
    ("deepseek_v3", "Almost <｜tool▁calls", "Almost <｜tool▁calls", []),
]


def _stream(parser_name: str, chunks: list[str]) -> tuple[ParsedOutput, list[ParsedOutput]]:
    """Everything a stream reported (summed), and each step's report."""
    parser = TOOL_PARSERS[parser_name]()
    steps = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    total = ParsedOutput()
    for step in steps:
        total.extend(step)
    return total, steps


def _random_chunks(text: str, seed: int) -> list[str]:
    rng, chunks, pos = random.Random(seed), [], 0
    while pos < len(text):
        size = rng.randint(1, MAX_RANDOM_CHUNK)
        chunks.append(text[pos:pos + size])
        pos += size
    return chunks


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_extract(parser, text, content, calls):
    assert TOOL_PARSERS[parser].extract(text) == ParsedOutput(content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_stream_in_any_split_adds_up_to_extract(parser, text, content, calls):
    expected = ParsedOutput(content, calls)
    assert _stream(parser, list(text))[0] == expected  # one character at a time
    for cut in range(len(text) + 1):  # every split in two
        assert _stream(parser, [text[:cut], text[cut:]])[0] == expected, cut
    for seed in RANDOM_SPLIT_SEEDS:
        assert _stream(parser, _random_chunks(text, seed))[0] == expected, seed


def test_hermes_streams_content_and_each_call_as_it_completes():
    _, steps = _stream("hermes", ["Let me ", "check.\n<tool", "_call>\n", HERMES_WEATHER[12:],
                                  "\n", HERMES_TIME, ""])
    assert steps == [
        ParsedOutput("Let me "),
        ParsedOutput("check.\n"),  # "<tool" waits: it may start a tag
        ParsedOutput(),
        ParsedOutput(calls=[WEATHER]),
        ParsedOutput(),  # whitespace after a call waits: it is dropped if nothing follows
        ParsedOutput(calls=[TIME]),
        ParsedOutput(),
        ParsedOutput(),  # finish
    ]


def test_llama3_json_holds_a_call_to_the_end_and_streams_plain_text():
    call = '{"name": "get_time", "parameters": {"timezone": "CET"}}'
    _, steps = _stream("llama3_json", [call[:10], call[10:]])
    assert steps == [ParsedOutput(), ParsedOutput(), ParsedOutput(calls=[TIME])]
    _, steps = _stream("llama3_json", ["The ", "answer"])
    assert steps == [ParsedOutput("The "), ParsedOutput("answer"), ParsedOutput()]


def test_deepseek_v3_streams_content_before_the_section():
    _, steps = _stream("deepseek_v3", ["Checking", ".<｜tool", CALLS_BEGIN[6:] + DS_WEATHER,
                                       CALLS_END])
    assert steps == [ParsedOutput("Checking"), ParsedOutput("."), ParsedOutput(calls=[WEATHER]),
                     ParsedOutput(), ParsedOutput()]


def test_held_marker_len():
    assert held_marker_len("abc<tool_c", "<tool_call>") == 7
    assert held_marker_len("abc<", "<tool_call>") == 1
    assert held_marker_len("abc", "<tool_call>") == 0
    assert held_marker_len("<tool_call>", "<tool_call>") == 0  # a whole marker is found, not held
