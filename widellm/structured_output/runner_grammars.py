"""The model runner's half: one matcher per running structured request, a token bitmask for
the rows sampled each step, and the matchers advanced with what was sampled.

The runner applies its steps in order and appends each sampled token before the next step is
prepared, so a matcher is always exactly at its request's last token, with or without async
scheduling. A preempted or finished request's matcher is dropped; a resumed request gets a new
one that replays the tokens it had produced.
"""

from __future__ import annotations

import logging

import torch

from widellm.structured_output.backend import CompiledGrammar, GrammarMatcher
from widellm.structured_output.bitmask import allocate_token_bitmask, apply_token_bitmask_

logger = logging.getLogger(__name__)


class RunnerGrammars:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.matchers: dict[str, GrammarMatcher] = {}

    def add(self, req_id: str, grammar: CompiledGrammar, output_token_ids: list[int]) -> None:
        """A matcher for ``req_id``, advanced past the tokens it already produced."""
        matcher = grammar.new_matcher()
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                raise ValueError(f"request {req_id}: its output token {token_id} breaks its "
                                 f"grammar")
        self.matchers[req_id] = matcher

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)

    def mask_logits_(self, logits: torch.Tensor, req_ids: list[str]) -> None:
        """Set to -inf (in place) every token the grammar of ``req_ids[j]`` does not allow
        next in ``logits[j]`` ([B, V] fp32). Rows without a grammar, or whose grammar is
        complete (a step scheduled before the request was seen to finish), are left as
        they are."""
        rows = [j for j, req_id in enumerate(req_ids)
                if (m := self.matchers.get(req_id)) is not None and not m.is_terminated()]
        if not rows:
            return
        bitmask = allocate_token_bitmask(len(req_ids), self.vocab_size)
        for j in rows:
            self.matchers[req_ids[j]].fill_bitmask(bitmask, j)
        apply_token_bitmask_(logits, bitmask, rows)

    def accept(self, req_ids: list[str], token_ids: list[int]) -> set[str]:
        """Advance each request's matcher by its sampled token; returns the requests whose
        grammar is now complete."""
        terminated = set()
        for req_id, token_id in zip(req_ids, token_ids):
            matcher = self.matchers.get(req_id)
            if matcher is None or matcher.is_terminated():
                continue
            if not matcher.accept_token(token_id):
                # The mask allowed only accepted tokens, so this is a backend bug; the request
                # goes on unconstrained rather than taking the whole batch down.
                logger.error("request %s: sampled token %d is not allowed by its grammar",
                             req_id, token_id)
                del self.matchers[req_id]
            elif matcher.is_terminated():
                terminated.add(req_id)
        return terminated
