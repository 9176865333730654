"""The seam between widellm and a grammar engine: compile a constraint once, then one matcher
per request that says which tokens may come next and advances token by token.

Bitmask format (shared by every backend, and what ``bitmask.py`` applies): int32 words,
``ceil(vocab_size / 32)`` per row; bit ``j`` of word ``w`` set means token ``32 * w + j`` is
allowed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from widellm.sampling_params import StructuredOutputsParams


class GrammarMatcher(ABC):
    """One request's position in its grammar. Lifecycle: created from a compiled grammar,
    ``accept_token`` for each token the request produced (replayed after a preemption), and
    ``fill_bitmask`` before each sampled token."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and no change) if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` ([rows, words] int32)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and has accepted a stop token: nothing may follow."""


class CompiledGrammar(ABC):
    """A constraint compiled against one vocabulary; shared by every request that uses it."""

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the grammar's start."""


class StructuredOutputBackend(ABC):
    """A grammar engine bound to one model's tokenizer and vocabulary.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: rows of the model's logits (may exceed the tokenizer's tokens; the
            extra ids are never allowed).
        stop_token_ids: the tokens that end a request (EOS), the only ones allowed once the
            grammar is complete.
        disable_any_whitespace: JSON without free whitespace (server default; a request may
            ask for it too).
    """

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile (or fetch from the backend's cache); raises ValueError for an invalid
        constraint."""

    @staticmethod
    @abstractmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Check a constraint without a tokenizer (cheap, in the frontend); raises ValueError
        saying what is wrong."""
