"""The sampler's forms that never read the device (what a GPU step needs to run ahead of
the host) keep exactly what the CPU's forms keep."""

import torch

from tests.worker.sampler_cases import build, seeded
from widellm.sampling_params import SamplingParams
from widellm.worker.sampler import TOP_P_CANDIDATES, apply_top_k_top_p, apply_top_p


def test_top_p_without_candidates_equals_with_them():
    """The GPU's form (every row fully sorted, no read of the device) keeps what the CPU's
    candidate-first form keeps, wide rows included."""
    vocab_size = 3 * TOP_P_CANDIDATES
    gen = seeded(5)
    logits = torch.cat([torch.randn(3, vocab_size, generator=gen) * 0.1,
                        torch.randn(3, vocab_size, generator=gen) * 4])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.95, 0.3, 0.8])
    candidates = apply_top_p(logits.clone(), top_p)
    full = apply_top_p(logits.clone(), top_p, num_candidates=vocab_size)
    assert torch.equal(candidates.isfinite(), full.isfinite())
    assert candidates.isfinite().sum(-1)[0] > TOP_P_CANDIDATES  # the wide rows were there


def test_top_k_with_the_hosts_largest_limit_equals_reading_it():
    gen = seeded(6)
    vocab_size = 64
    params = [SamplingParams(top_k=5), SamplingParams(), SamplingParams(top_k=20),
              SamplingParams(top_k=1)]
    md = build(params, vocab_size)
    assert md.max_top_k == 20
    logits = torch.randn(len(params), vocab_size, generator=gen)
    read = apply_top_k_top_p(logits.clone(), md.top_k, None)
    given = apply_top_k_top_p(logits.clone(), md.top_k, None, md.max_top_k)
    assert torch.equal(read, given)
    assert read.isfinite().sum(-1).tolist() == [5, vocab_size, 20, 1]
    assert build([SamplingParams()], vocab_size).max_top_k == 0
