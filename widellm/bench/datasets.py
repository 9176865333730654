"""Benchmark prompts. ``random``: token ids drawn from a fixed seed, the same on every engine
(the vLLM and transformers scripts in benchmarks/ build the identical list)."""

from __future__ import annotations

import numpy as np

# Stay clear of the low ids where special tokens usually live, and of the very top of the
# vocabulary where some tokenizers keep added tokens.
TOKEN_ID_MARGIN = 100


def random_token_prompts(
    num_prompts: int, input_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """num_prompts lists of input_len ids in [TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN)."""
    low, high = TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN
    if high <= low:
        low, high = 0, vocab_size
    rng = np.random.RandomState(seed)
    return rng.randint(low, high, size=(num_prompts, input_len)).tolist()
