"""Incremental detokenization with stop strings.

Text is produced token by token with ``tokenizers``' DecodeStream, which holds back bytes of
a multi-byte UTF-8 character split across tokens until it is complete. Stop strings are
searched only in the tail that new text could have completed; while streaming, the last
``len(longest stop) - 1`` characters are held back so a stop string split across two steps is
never emitted.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool,
        include_stop_str_in_output: bool,
    ) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # Prime the stream with the prompt's tail so the first output token decodes in
        # context (a leading-space token after the prompt keeps its space).
        for token_id in prompt_token_ids[-_PRIME_TOKENS:]:
            self._stream.step(self._backend, token_id)
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._num_emitted = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string matched (text then ends at it), else None."""
        for token_id in new_token_ids:
            piece = self._stream.step(self._backend, token_id)
            if not piece:
                continue
            start = max(len(self.text) - self.hold_back, 0)
            self.text += piece
            if self.stop:
                matched = self._find_stop(start)
                if matched is not None:
                    return matched
        return None

    def _find_stop(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop_str_in_output else self.text[:i]
        return s

    def get_delta(self, finished: bool) -> str:
        """New text since the last call, minus the held-back tail unless finished."""
        end = len(self.text) if finished else max(len(self.text) - self.hold_back, 0)
        end = max(end, self._num_emitted)
        delta = self.text[self._num_emitted:end]
        self._num_emitted = end
        return delta


# Enough prompt tokens to give the first output token its left context; one is usually
# sufficient, a few cover byte-fallback sequences.
_PRIME_TOKENS = 4
