"""Applying a token bitmask (format in ``backend.py``) to a batch of logits: disallowed
tokens become -inf. ``apply_token_bitmask_`` is the fast path (xgrammar's CPU kernel, or its
GPU kernel on CUDA); ``reference_apply_token_bitmask`` unpacks the bits in plain torch, for
the tests that compare the two."""

from __future__ import annotations

import torch
import xgrammar as xgr

BITS_PER_WORD = 32


def num_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS_PER_WORD)


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32, every token allowed."""
    return torch.full((rows, num_words(vocab_size)), -1, dtype=torch.int32)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Mask ``logits[r]`` ([B, V], fp32, in place) with ``bitmask[r]`` for each r in rows."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    indices=rows)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, words] int32 -> [R, vocab_size] bool, True where the token is allowed."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def reference_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                                  rows: list[int]) -> torch.Tensor:
    """A masked copy of ``logits`` ([B, V]): the plain twin of ``apply_token_bitmask_``."""
    out = logits.clone()
    allowed = unpack_bitmask(bitmask[rows], logits.shape[-1])
    out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out
