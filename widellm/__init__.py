"""widellm: an inference and serving engine for sparse Mixture-of-Experts LLMs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from widellm.engine.llm import LLM
    from widellm.outputs import CompletionOutput, RequestOutput
    from widellm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

# The public names, imported on first use (PEP 562): an engine-core process imports
# ``widellm.engine.core_proc``, and importing the package must not drag the whole frontend
# (LLM, its argument parsing, the tokenizer) into every rank's start-up.
_LAZY = {"LLM": "widellm.engine.llm", "SamplingParams": "widellm.sampling_params",
         "RequestOutput": "widellm.outputs", "CompletionOutput": "widellm.outputs"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'widellm' has no attribute {name!r}")
