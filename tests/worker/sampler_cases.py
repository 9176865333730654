"""Shared by the sampler tests: sampling metadata built the way the runner builds it, seeded
generators, and a sampler call that leaves the caller's logits alone."""

from __future__ import annotations

import torch

from widellm.worker.sampler import Sampler
from widellm.worker.sampling_metadata import SamplingMetadata

NEG_INF = float("-inf")


def build(params, vocab_size, outputs=None, prompts=None, generators=None, eos=None):
    outputs = [[] for _ in params] if outputs is None else outputs
    return SamplingMetadata.build(
        params, outputs, vocab_size, generators=generators, prompt_token_ids=prompts,
        eos_token_ids=eos,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_ids(gen: torch.Generator, vocab_size: int, n: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=gen).tolist()


def sample(logits, md):
    # The sampler consumes its input; tests keep theirs.
    return Sampler()(logits.clone(), md)

