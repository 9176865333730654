"""The xgrammar backend (https://github.com/mlc-ai/xgrammar): grammars compiled against the
model's vocabulary into per-state token masks, cached by the compiler itself."""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from widellm.sampling_params import StructuredOutputsParams
from widellm.structured_output.backend import (
    CompiledGrammar, GrammarMatcher, StructuredOutputBackend,
)

# Compiled grammars the compiler keeps (least recently used go first): token-mask caches
# of large schemas take megabytes each.
COMPILE_CACHE_BYTES = 256 << 20
# Threads one compilation may use. The engine core compiles one grammar at a time, off the
# step loop; more threads would take cores from the forward on small CPU machines.
COMPILE_THREADS = 1
# xgrammar prefixes its errors with a time and a C++ source location.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# "json_object": any JSON object; not strict, so its keys are free (strict mode would
# default additionalProperties to false and allow only {}).
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar 0.2.9 writes the characters of a length-bounded JSON string (maxLength) as
# "anything but quote, backslash, CR, LF", which lets raw control characters through: JSON
# forbids those unescaped and json.loads rejects them. Its unbounded strings exclude them;
# the same exclusion is added here to the EBNF the schema converts to.
_LAX_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
# Most whitespace characters allowed in a row between two JSON tokens: room for a newline and
# deeply nested indentation, but a small model sampling from a JSON grammar can no longer
# spend its whole budget on blank lines (the output would end truncated, invalid).
MAX_WHITESPACE_RUN = 32


def _clean(err: Exception) -> str:
    return _CPP_PREFIX.sub("", str(err).strip())


def _schema_text(schema: str | dict) -> str:
    if isinstance(schema, dict):
        return json.dumps(schema)
    try:
        json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"the schema is not valid JSON: {e}") from None
    return schema


def _choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``; xgrammar's EBNF literals take JSON's string escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def json_schema_ebnf(schema: str, any_whitespace: bool, strict_mode: bool = True) -> str:
    """The EBNF grammar of a JSON schema, its strings limited to JSON's characters."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace,
                                           strict_mode=strict_mode,
                                           max_whitespace_cnt=MAX_WHITESPACE_RUN)
    return str(grammar).replace(_LAX_STRING_CHAR, _JSON_STRING_CHAR)


def _describe(params: StructuredOutputsParams) -> str:
    return {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
            "choice": "choice", "grammar": "EBNF grammar"}[params.kind]


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XgrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def new_matcher(self) -> GrammarMatcher:
        return XgrammarMatcher(self.compiled)


class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 disable_any_whitespace: bool = False) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS,
                                            cache_limit_bytes=COMPILE_CACHE_BYTES)
        self.disable_any_whitespace = disable_any_whitespace

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        kind, c = params.kind, self.compiler
        any_whitespace = not (params.disable_any_whitespace or self.disable_any_whitespace)
        try:
            if kind == "json":
                compiled = c.compile_grammar(json_schema_ebnf(_schema_text(params.json),
                                                              any_whitespace))
            elif kind == "json_object":
                compiled = c.compile_grammar(json_schema_ebnf(_ANY_OBJECT_SCHEMA, any_whitespace,
                                                              strict_mode=False))
            elif kind == "regex":
                compiled = c.compile_regex(params.regex)
            elif kind == "choice":
                compiled = c.compile_grammar(_choice_ebnf(params.choice))
            else:
                compiled = c.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"invalid {_describe(params)}: {_clean(e)}") from None
        return XgrammarCompiled(compiled)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        kind = params.kind
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(_schema_text(params.json))
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(_choice_ebnf(params.choice))
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(params.grammar)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"invalid {_describe(params)}: {_clean(e)}") from None
