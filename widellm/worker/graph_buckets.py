"""Which row count a decode step runs at when decode steps are captured as CUDA graphs: one
graph per capture size, a step padded up to the smallest size that holds it (the padding rows
have no cache slot, sit in no query and go to expert -1: ``pad_attention_metadata``), and a
step larger than every size run eagerly, as it is.

Sizes as vLLM picks them: 1, 2, 4, then every multiple of 8 up to the largest batch.
"""

from __future__ import annotations

import bisect

# The smallest sizes, each captured: batch 1-4 decode is the latency-bound case.
SMALL_CAPTURE_SIZES = (1, 2, 4)
CAPTURE_SIZE_STEP = 8
# Graphs above this many rows gain little over eager launches and each holds its own memory.
MAX_CAPTURE_SIZE = 512


def default_capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """(1, 2, 4, 8, 16, ..., up to min(max_num_seqs, max_size) rounded up to a multiple of 8).

    >>> default_capture_sizes(20)
    (1, 2, 4, 8, 16, 24)
    >>> default_capture_sizes(3)
    (1, 2, 4)
    """
    candidates = SMALL_CAPTURE_SIZES + tuple(
        range(CAPTURE_SIZE_STEP, max_size + 1, CAPTURE_SIZE_STEP))
    # Up to the first size that holds the largest batch.
    return candidates[: bisect.bisect_left(candidates, min(max_num_seqs, max_size)) + 1]


def bucket_for(num_rows: int, sizes: tuple[int, ...]) -> int | None:
    """The capture size a step of ``num_rows`` rows runs at; None: run it eagerly (no sizes,
    or more rows than the largest).

    >>> bucket_for(5, (1, 2, 4, 8))
    8
    >>> bucket_for(9, (1, 2, 4, 8)) is None
    True
    """
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None
