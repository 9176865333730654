"""``--enable-log-requests``: one log line per request as it arrives (its id, sampling
parameters, prompt length and the prompt, cut to ``--max-log-len``), as vLLM's server logs
them. Off by default: prompts are the users' data."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from widellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestLogger:
    def __init__(self, max_log_len: int | None = None) -> None:
        if max_log_len is not None and max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {max_log_len}")
        # None: the whole prompt; N: its first N characters (text) or ids (token prompts).
        self.max_log_len = max_log_len

    def log_request(self, request_id: str, text: str | None, token_ids: Sequence[int],
                    params: SamplingParams) -> None:
        prompt: str | list[int] = text if text is not None else list(token_ids)
        if self.max_log_len is not None:
            prompt = prompt[:self.max_log_len]
        logger.info("received request %s: %d prompt tokens, params: %s, prompt: %r",
                    request_id, len(token_ids), params, prompt)
