"""Grammar engines by the name ``--structured-outputs-config`` uses."""

from __future__ import annotations

from typing import Any

from widellm.config import StructuredOutputsConfig
from widellm.structured_output.backend import StructuredOutputBackend
from widellm.structured_output.xgrammar_backend import XgrammarBackend

BACKENDS: dict[str, type[StructuredOutputBackend]] = {"xgrammar": XgrammarBackend}
# What "auto" means today: the only backend, and the one vLLM defaults to.
AUTO_BACKEND = "xgrammar"


def backend_class(name: str) -> type[StructuredOutputBackend]:
    return BACKENDS[AUTO_BACKEND if name == "auto" else name]


def make_backend(config: StructuredOutputsConfig, tokenizer: Any, vocab_size: int,
                 stop_token_ids: list[int]) -> StructuredOutputBackend:
    return backend_class(config.backend)(tokenizer, vocab_size, stop_token_ids,
                                         config.disable_any_whitespace)
