"""Per-row reference twins of the batched sampler (``sampler.py``): slow, plain, one token
at a time, for the tests that compare the two."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from widellm.sampling_params import SAMPLING_EPS, SamplingParams


def reference_apply_penalties_row(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
) -> torch.Tensor:
    """logits: [V] -> penalised copy [V] fp32, one token at a time."""
    out = logits.to(torch.float32).clone()
    vocab_size = out.shape[0]
    counts: dict[int, int] = {}
    for t in output_token_ids:
        if 0 <= t < vocab_size:
            counts[t] = counts.get(t, 0) + 1
    seen = set(counts) | {t for t in prompt_token_ids if 0 <= t < vocab_size}
    repetition = torch.tensor(params.repetition_penalty, dtype=torch.float32)
    frequency = torch.tensor(params.frequency_penalty, dtype=torch.float32)
    presence = torch.tensor(params.presence_penalty, dtype=torch.float32)
    for t in seen:
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t, count in counts.items():
        out[t] = out[t] - frequency * count
        out[t] = out[t] - presence
    return out


def reference_filter_row(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [V] (already penalised) -> [V] bool, the tokens top-k, top-p and min-p keep."""
    scaled = logits.to(torch.float32) / params.temperature
    values = scaled.tolist()
    vocab_size = len(values)
    order = sorted(range(vocab_size), key=lambda i: (-values[i], i))
    keep = [v != float("-inf") for v in values]

    if params.top_k > 0:
        kth_largest = values[order[min(params.top_k, vocab_size) - 1]]
        keep = [k and v >= kth_largest for k, v in zip(keep, values)]

    if params.top_p < 1.0:
        probs = torch.softmax(scaled.masked_fill(~torch.tensor(keep), float("-inf")), -1).tolist()
        mass = 0.0
        for i in order:
            if not keep[i]:
                continue
            if mass >= params.top_p:
                keep[i] = False
            else:
                mass += probs[i]

    if params.min_p > 0.0:
        probs = torch.softmax(scaled.masked_fill(~torch.tensor(keep), float("-inf")), -1).tolist()
        top_prob = max(probs)
        keep = [k and p >= params.min_p * top_prob for k, p in zip(keep, probs)]
    return torch.tensor(keep)


def reference_sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    stop_token_ids_to_mask: Sequence[int] = (),
    noise: torch.Tensor | None = None,
) -> int:
    """Sample one token for one row. logits: [V]; noise: [V] Exponential(1) draws (the q of
    the exponential race), required unless the row is greedy."""
    logits = logits.to(torch.float32).clone()
    if params.allowed_token_ids is not None:
        allowed = set(params.allowed_token_ids)
        for t in range(logits.shape[0]):
            if t not in allowed:
                logits[t] = float("-inf")
    for t, bias in (params.logit_bias or {}).items():
        logits[t] += bias
    unmasked = logits.clone()
    for t in stop_token_ids_to_mask:
        logits[t] = float("-inf")
    if bool((logits == float("-inf")).all()):  # nothing left: the stop ids stay allowed
        logits = unmasked
    logits = reference_apply_penalties_row(logits, params, prompt_token_ids, output_token_ids)
    if params.temperature < SAMPLING_EPS:
        return int(logits.argmax())
    if noise is None:
        raise ValueError("noise is required for a random row")
    keep = reference_filter_row(logits, params)
    scaled = (logits / params.temperature).masked_fill(~keep, float("-inf"))
    return int((torch.softmax(scaled, -1) / noise).argmax())
