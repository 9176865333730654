"""Per-transfer trace of the MoE exchanges, to split a rank's exposed communication into the
time it waited for a peer to reach the exchange and the time the transfer itself took.

The step breakdown's ``comm_exposed`` counts everything a rank spends blocked in a transfer's
``wait``, which on one machine is mostly the slower rank's lag, not bytes on a wire. Skew
cannot be hidden by overlapping a transfer with compute; the transfer can. With
``WIDELLM_COMM_TRACE_DIR`` set and ``--collect-step-breakdown`` on, every rank logs each MoE
transfer (:class:`Exchange`) and writes ``rank{N}.json`` there when its engine core stops;
:func:`split_exposed` lines the ranks' logs up by launch order (every rank launches the same
transfers in the same order, dummy batches included, or the collectives would not pair) and
takes a transfer's start as the moment its last rank launched.

Times are ``time.perf_counter()``: CLOCK_MONOTONIC on Linux, one clock for every process of a
machine, so the split holds for ranks on one host only. The log keeps every transfer of the
run in memory (about 100 bytes each, tens of thousands in a benchmark): a profiling aid for
benchmark runs, not for a server left running.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

COMM_TRACE_DIR_ENV = "WIDELLM_COMM_TRACE_DIR"


@dataclass(frozen=True, slots=True)
class Exchange:
    """One transfer as one rank saw it (seconds on the machine's monotonic clock)."""

    seq: int  # launch order on this rank: the same transfer has the same seq on every rank
    launched: float
    done: float | None  # completion, from the work's future (None: the handle had none)
    wait_start: float
    wait_end: float
    idle: bool  # launched by a dummy batch (the rank had no work; not its own traffic)
    tokens: int  # the forward's largest rank's rows (a micro-batch's under DBO); -1: unknown


class ExchangeLog:
    """A rank's transfers in launch order; appended from the forward's thread(s)."""

    def __init__(self) -> None:
        self.records: list[Exchange] = []
        self._seq = itertools.count()

    def next_seq(self) -> int:
        return next(self._seq)

    def add(self, record: Exchange) -> None:
        self.records.append(record)  # atomic under the GIL: DBO's two threads both append

    def dump(self, path: Path) -> None:
        """Write the log as JSON rows (the fields in order), sorted by seq."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(sorted(astuple(r) for r in self.records)))


def trace_dir() -> Path | None:
    """Where ranks write their logs, or None when tracing is off."""
    value = os.environ.get(COMM_TRACE_DIR_ENV)
    return Path(value) if value else None


def load(directory: Path) -> list[list[Exchange]]:
    """The ``rank{N}.json`` logs of one run, rank order."""
    paths = sorted(directory.glob("rank*.json"), key=lambda p: int(p.stem.removeprefix("rank")))
    if not paths:
        raise ValueError(f"no rank*.json exchange logs in {directory}")
    return [[Exchange(*row) for row in json.loads(p.read_text())] for p in paths]


def split_exposed(logs: Sequence[Sequence[Exchange]],
                  max_tokens: int | None = None) -> list[dict[str, float]]:
    """Per rank, its own (non-idle) transfers' time split by who it waited for.

    ``logs[r]``: rank r's exchanges; every rank must have logged the same seqs. A transfer
    starts at ``ready``, the latest launch over the ranks. ``max_tokens``: count only the
    transfers of forwards of at most this many rows on the largest rank (e.g. decode steps
    only). Keys, seconds summed over transfers:

    - ``exposed_s``: blocked in ``wait`` (the step breakdown's ``comm_exposed``);
    - ``exposed_waiting_for_peers_s``: the part of it before ``ready``;
    - ``exposed_transfer_s``: the rest, after every rank had launched;
    - ``hidden_s``: launch to completion while the rank did other work (``comm_window``);
    - ``transfer_s``: ``ready`` to completion, the transfer's own duration (transfers without
      a completion time count until their wait ended);
    - ``exchanges``: how many.

    Example, two ranks, one transfer: rank 0 launches at 1.0 and waits from 1.5 to 4.0, rank 1
    launches at 3.0 and waits from 3.5 to 4.0, it completes at 3.9; ready = 3.0. Rank 0:
    exposed 2.5 = 1.5 waiting for rank 1 (1.5 -> 3.0) + 1.0 transfer; hidden 0.5 (1.0 -> 1.5);
    transfer 0.9. Rank 1: exposed 0.5, all transfer; hidden 0.5; transfer 0.9.
    """
    by_seq = [{e.seq: e for e in log} for log in logs]
    seqs = set(by_seq[0])
    for rank, log in enumerate(by_seq):
        if set(log) != seqs:
            raise ValueError(f"rank {rank} logged {len(log)} exchanges, rank 0 {len(seqs)}: "
                             f"the logs are not of one run (or a rank stopped early)")
    ready = {s: max(log[s].launched for log in by_seq) for s in seqs}
    out = []
    for log in by_seq:
        t = dict.fromkeys(("exposed_s", "exposed_waiting_for_peers_s", "exposed_transfer_s",
                           "hidden_s", "transfer_s", "exchanges"), 0.0)
        for s, e in log.items():
            if e.idle or (max_tokens is not None and e.tokens > max_tokens):
                continue
            exposed = e.wait_end - e.wait_start
            peers = min(max(0.0, ready[s] - e.wait_start), exposed)
            done = e.done if e.done is not None else e.wait_end
            t["exposed_s"] += exposed
            t["exposed_waiting_for_peers_s"] += peers
            t["exposed_transfer_s"] += exposed - peers
            t["hidden_s"] += max(0.0, min(done, e.wait_start) - e.launched)
            t["transfer_s"] += max(0.0, done - ready[s])
            t["exchanges"] += 1
        out.append(t)
    return out
