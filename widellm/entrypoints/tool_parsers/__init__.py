"""Tool-call parsers by the names ``--tool-call-parser`` takes (vLLM's names)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from widellm.entrypoints.tool_parsers.base import (
    ParsedOutput, ParsedToolCall, ToolParser,
)
from widellm.entrypoints.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from widellm.entrypoints.tool_parsers.hermes import HermesToolParser
from widellm.entrypoints.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: Mapping[str, type[ToolParser]] = MappingProxyType({
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
})

__all__ = ["TOOL_PARSERS", "ParsedOutput", "ParsedToolCall", "ToolParser"]
