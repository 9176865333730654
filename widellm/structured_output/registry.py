"""Grammar engines by the name ``--structured-outputs-config`` uses.

Each engine is imported when first asked for: a grammar library is a large import (xgrammar
with its tokenizer glue: ~0.5 s here) that an engine core serving no constrained request, and
every rank process's start-up, should not pay."""

from __future__ import annotations

import importlib
from typing import Any

from widellm.config import StructuredOutputsConfig
from widellm.structured_output.backend import StructuredOutputBackend

# name -> "module:class"
BACKENDS: dict[str, str] = {
    "xgrammar": "widellm.structured_output.xgrammar_backend:XgrammarBackend",
}
# What "auto" means today: the only backend, and the one vLLM defaults to.
AUTO_BACKEND = "xgrammar"


def backend_class(name: str) -> type[StructuredOutputBackend]:
    module, cls = BACKENDS[AUTO_BACKEND if name == "auto" else name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_backend(config: StructuredOutputsConfig, tokenizer: Any, vocab_size: int,
                 stop_token_ids: list[int]) -> StructuredOutputBackend:
    return backend_class(config.backend)(tokenizer, vocab_size, stop_token_ids,
                                         config.disable_any_whitespace)
