"""Helpers shared by the side-by-side benchmark scripts here. Plain Python + numpy: the
scripts run in other engines' virtualenvs, where widellm is not installed."""

from __future__ import annotations

import json

# Token ids this close to either end of the vocabulary are skipped: special tokens and byte
# tokens cluster there in real tokenizers. widellm.bench.datasets uses the same rule.
TOKEN_ID_MARGIN = 100
GIB = 1 << 30
KIB = 1024


def random_prompt_token_ids(
    vocab_size: int, num_prompts: int, input_len: int, seed: int
) -> list[list[int]]:
    """The shared benchmark prompts: uniform token ids in [100, vocab_size - 100)."""
    import numpy as np

    rng = np.random.RandomState(seed)
    ids = rng.randint(
        TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN, size=(num_prompts, input_len)
    )
    return ids.tolist()


def write_result_json(path: str | None, result: dict) -> None:
    """Write one run's result where ``--output-json`` points (nothing when unset)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


def throughput_fields(num_prompts: int, input_tokens: int, output_tokens: int,
                      elapsed_s: float) -> dict:
    """The rates every throughput script reports, computed one way."""
    return {
        "elapsed_s": round(elapsed_s, 3),
        "requests_per_s": num_prompts / elapsed_s,
        "output_tokens_per_s": output_tokens / elapsed_s,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed_s,
    }
