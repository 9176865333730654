"""Dual-batch-overlap decisions: the votes follow vLLM's thresholds (a dummy batch follows),
``on`` splits whenever the vote allows, and ``auto``'s choices, fed the same agreed times on
every rank, are a fixed sequence: alternate until each setting has MIN_SAMPLES samples, then
the faster one, with a probe of the other every REPROBE_EVERY-th step of the key."""

from __future__ import annotations

import numpy as np
import torch

from widellm.config import ParallelConfig
from widellm.distributed.lockstep import SplitVote, StepAgreement
from widellm.engine.dbo_policy import MIN_SAMPLES, REPROBE_EVERY, AutoDbo, DboPolicy
from widellm.forward_context import DPMetadata
from widellm.layers.attention_metadata import build_attention_metadata
from widellm.worker.input_batch import BatchInputs, ModelInput


def _config(mode: str) -> ParallelConfig:
    return ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, enable_dbo=mode,
                          dbo_decode_token_threshold=4, dbo_prefill_token_threshold=8)


def _decodes(n: int) -> ModelInput:
    batch = BatchInputs([str(i) for i in range(n)], torch.zeros(n, dtype=torch.int64),
                        np.full(n, 3), np.ones(n, np.int64), np.full(n, 4),
                        np.zeros((n, 1), np.int64), list(range(n)))
    md = build_attention_metadata(batch.query_lens, batch.context_lens, batch.positions,
                                  batch.block_table, 16)
    return ModelInput(batch, md, batch.input_ids, torch.from_numpy(batch.positions))


def _prompt(n: int) -> ModelInput:
    batch = BatchInputs(["p"], torch.zeros(n, dtype=torch.int64), np.arange(n),
                        np.array([n]), np.array([n]), np.zeros((1, 1), np.int64), [0])
    md = build_attention_metadata(batch.query_lens, batch.context_lens, batch.positions,
                                  batch.block_table, 16)
    return ModelInput(batch, md, batch.input_ids, torch.from_numpy(batch.positions))


def test_votes_follow_the_thresholds():
    on = DboPolicy(_config("on"))
    assert [on.vote(_decodes(n)) for n in (3, 4)] == [SplitVote.NO, SplitVote.DECODE]
    assert [on.vote(_prompt(n)) for n in (7, 8)] == [SplitVote.NO, SplitVote.PREFILL]
    assert on.vote(None) == SplitVote.FOLLOW
    off = DboPolicy(_config("off"))
    assert off.vote(_decodes(64)) == SplitVote.NO and off.vote(None) == SplitVote.NO


def _agreement(split: bool, rows: int = 40, last_us: int = 0) -> StepAgreement:
    return StepAgreement(True, False, DPMetadata((rows, 1)), split=split, last_forward_us=last_us)


def test_on_splits_what_the_vote_allows():
    on = DboPolicy(_config("on"))
    assert [on.decide(_agreement(s)) for s in (True, False, True)] == [True, False, True]
    assert not on.decide(StepAgreement(False, False, DPMetadata((1, 1)), split=True))


def test_auto_measures_both_then_keeps_the_faster():
    policy = DboPolicy(_config("auto"))
    # Split steps take 30 us per row of the largest rank, whole ones 50: split wins.
    us_per_row = {True: 30, False: 50}
    choices, last = [], 0
    for _ in range(REPROBE_EVERY + 2):
        choice = policy.decide(_agreement(True, rows=40, last_us=last))
        choices.append(choice)
        last = us_per_row[choice] * 40
    warmup = [False, True] * MIN_SAMPLES
    assert choices[:len(warmup)] == warmup
    assert choices[len(warmup):REPROBE_EVERY - 1] == [True] * (REPROBE_EVERY - 1 - len(warmup))
    assert choices[REPROBE_EVERY - 1] is False  # the periodic probe of the other setting
    assert choices[REPROBE_EVERY:] == [True, True]
    assert policy.auto.preferred() == {(False, 6): True}


def test_auto_keys_are_kind_and_size():
    auto = AutoDbo()
    for _ in range(MIN_SAMPLES):
        auto.observe((False, 6), True, 2.0)
        auto.observe((False, 6), False, 1.0)
    assert auto.choose((False, 6)) is False  # whole was faster at this size
    # A new key measures from scratch: whole first, then the setting with fewer samples.
    assert auto.choose((True, 6)) is False
    auto.observe((True, 6), False, 1.0)
    assert auto.choose((True, 6)) is True
