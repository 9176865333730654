"""When a lockstep step runs as two overlapped micro-batches (dual-batch overlap).

Each rank votes from its own batch (vLLM's rule: a batch of decodes only splits at
``--dbo-decode-token-threshold`` tokens or more, one with prompt tokens at
``--dbo-prefill-token-threshold``; a dummy batch follows); the vote decides whether the ranks
*may* split. ``--enable-dbo on`` then always splits; ``auto`` splits only where splitting was
measured faster on this deployment, per kind of step and size:

- the key of a step is (any prompt tokens, bit length of the largest rank's rows): steps of
  one key have about the same compute and communication per row;
- each key keeps the last ``WINDOW`` forward times per row of each setting, taken from the
  next vote (the slowest rank's forward, so every rank records the same number);
- until both settings have ``MIN_SAMPLES`` samples the key alternates between them; then it
  picks the lower median, and every ``REPROBE_EVERY``-th step of the key tries the other one
  so that a change in load (longer contexts, another backend's traffic) is noticed. One
  sample each is enough to start: a prompt-heavy run may have only a handful of big steps per
  key, and every measuring step of the slower setting is a loss (steps of one run differ by
  a few percent, far less than runs do; the window's median then corrects a bad start).

Everything it reads is agreed by the vote, so every rank makes the same choice: no rank can
split a step its peers run whole (their collectives would not pair).
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field

from widellm.config import ParallelConfig
from widellm.distributed.lockstep import SplitVote, StepAgreement
from widellm.worker.input_batch import ModelInput

WINDOW = 16
MIN_SAMPLES = 1
REPROBE_EVERY = 32

StepKey = tuple[bool, int]


@dataclass
class _KeyStats:
    # Forward seconds per row of the largest rank, by split (False: whole, True: split).
    samples: dict[bool, deque[float]] = field(
        default_factory=lambda: {False: deque(maxlen=WINDOW), True: deque(maxlen=WINDOW)})
    decisions: int = 0


class AutoDbo:
    """The measured choice of ``--enable-dbo auto`` (see the module docstring)."""

    def __init__(self) -> None:
        self.stats: defaultdict[StepKey, _KeyStats] = defaultdict(_KeyStats)

    def choose(self, key: StepKey) -> bool:
        st = self.stats[key]
        st.decisions += 1
        whole, split = st.samples[False], st.samples[True]
        if len(whole) < MIN_SAMPLES or len(split) < MIN_SAMPLES:
            return len(split) < len(whole)  # fill the emptier side, starting whole
        best = statistics.median(split) < statistics.median(whole)
        return (not best) if st.decisions % REPROBE_EVERY == 0 else best

    def observe(self, key: StepKey, split: bool, seconds_per_row: float) -> None:
        self.stats[key].samples[split].append(seconds_per_row)

    def preferred(self) -> dict[StepKey, bool | None]:
        """Each key's current choice (None while still measuring), for logs and benchmarks."""
        out: dict[StepKey, bool | None] = {}
        for key, st in sorted(self.stats.items()):
            whole, split = st.samples[False], st.samples[True]
            out[key] = (statistics.median(split) < statistics.median(whole)
                        if len(whole) >= MIN_SAMPLES and len(split) >= MIN_SAMPLES else None)
        return out


class DboPolicy:
    """One rank's dual-batch-overlap votes and decisions.

    Args:
        config: ``enable_dbo`` (off / on / auto) and the two thresholds.
    """

    def __init__(self, config: ParallelConfig) -> None:
        self.mode = config.enable_dbo
        self.decode_threshold = config.dbo_decode_token_threshold
        self.prefill_threshold = config.dbo_prefill_token_threshold
        self.auto = AutoDbo() if self.mode == "auto" else None
        # The previous forward's key, split and largest row count, awaiting its time.
        self._pending: tuple[StepKey, bool, int] | None = None

    def vote(self, model_input: ModelInput | None) -> SplitVote:
        """This rank's say on splitting the step it prepared (None: a dummy batch)."""
        if self.mode == "off":
            return SplitVote.NO
        if model_input is None:
            return SplitVote.FOLLOW
        rows = model_input.num_rows
        if model_input.attn_metadata.prefills:
            return SplitVote.PREFILL if rows >= self.prefill_threshold else SplitVote.NO
        return SplitVote.DECODE if rows >= self.decode_threshold else SplitVote.NO

    def decide(self, agreement: StepAgreement) -> bool:
        """Whether this step splits; call once per vote, on every rank (same answer on all)."""
        if self.auto is not None and self._pending is not None and agreement.last_forward_us:
            key, split, rows = self._pending
            self.auto.observe(key, split, agreement.last_forward_us * 1e-6 / rows)
        self._pending = None
        if not agreement.any_has_work:
            return False
        rows = agreement.dp_metadata.max_num_tokens
        key = (agreement.any_prefill, rows.bit_length())
        split = agreement.split
        if split and self.auto is not None:
            split = self.auto.choose(key)
        if agreement.split:
            self._pending = (key, split, rows)
        return split
