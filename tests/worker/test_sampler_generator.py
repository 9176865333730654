"""The sampler's own generator: unseeded random rows draw from it (an engine core's stream,
seeded from --seed and its rank), never from torch's default generator."""

from __future__ import annotations

import torch

from widellm.sampling_params import SamplingParams
from widellm.worker.sampler import Sampler, fill_exponential_, row_argmax
from widellm.worker.sampling_metadata import SamplingMetadata

VOCAB = 1000
ROWS = 6
STEPS = 5


def _draws(generator: torch.Generator | None) -> list[list[int]]:
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0)] * ROWS
    md = SamplingMetadata.build(params, [[] for _ in params], VOCAB)
    sampler = Sampler(generator)
    return [sampler(logits.clone(), md).sampled_token_ids.tolist() for _ in range(STEPS)]


def test_unseeded_rows_follow_the_sampler_generator_only():
    torch.manual_seed(123)
    default_before = torch.get_rng_state()
    first = _draws(torch.Generator().manual_seed(42))
    assert torch.equal(torch.get_rng_state(), default_before)  # default stream untouched
    torch.manual_seed(999)  # a different default stream changes nothing
    assert _draws(torch.Generator().manual_seed(42)) == first
    assert _draws(torch.Generator().manual_seed(43)) != first


def test_the_draws_are_the_exponential_race_over_the_generator_noise():
    # Reference twin: the same race written out (argmax of probs / q, q ~ Exp(1) from the
    # generator), over the first step of _draws.
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0))
    q = fill_exponential_(torch.empty(ROWS, VOCAB), torch.Generator().manual_seed(42))
    expected = row_argmax(logits.softmax(dim=-1) / q).tolist()
    assert _draws(torch.Generator().manual_seed(42))[0] == expected
