"""Turns one step's logits into next tokens, and the logprobs requests asked for.

Order, as in vLLM: logprobs from the raw logits; allowed_token_ids; logit_bias; min_tokens
masking (never masking a row's every allowed token: a grammar that admits only EOS wins);
penalties; then greedy rows take the argmax while random rows go through temperature, top-k,
top-p, min-p and an exponential race (argmax of probs / q, q ~ Exponential(1)), which samples
from probs without a cumulative-sum search and lets a seeded row draw q from its own
generator.

The batched functions are written for speed (no loops over rows except seeded generators);
``sampler_reference.py`` does the same per row in plain code, for tests.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from widellm.sampling_params import SAMPLING_EPS
from widellm.worker.sampling_metadata import SamplingMetadata, pad_rows

# How many of the most likely tokens top-p examines before falling back to a full sort.
TOP_P_CANDIDATES = 1024
# Width of the slices `row_argmax` takes maxima over.
ARGMAX_CHUNK = 1024

# Domain tag of the per-rank seed derivation, so its digests collide with no other use.
_CORE_SEED_TAG = b"widellm-engine-core-seed"
# torch.Generator.manual_seed takes a 64-bit value; keep it non-negative.
_SEED_MASK = (1 << 63) - 1


def engine_core_seed(seed: int, dp_rank: int) -> int:
    """The seed of rank ``dp_rank``'s sampling stream under ``--seed seed``: the first 8 bytes
    of sha256(tag, seed, rank), as a non-negative int. A hash, not ``seed + rank``, so
    (seed 0, rank 1) and (seed 1, rank 0) do not share a stream."""
    digest = hashlib.sha256(b"%s:%d:%d" % (_CORE_SEED_TAG, seed, dp_rank)).digest()
    return int.from_bytes(digest[:8], "little") & _SEED_MASK


@dataclass
class LogprobsTensors:
    """Logprobs of N positions, sampled token first.

    logprob_token_ids: [N, 1 + k] int64; column 0 is the sampled (or given) token, columns
        1.. the k most likely tokens, most likely first.
    logprobs: [N, 1 + k] fp32, matching ``logprob_token_ids``.
    selected_token_ranks: [N] int64; 1 + number of tokens strictly more likely than the
        sampled one (so the most likely token has rank 1, and tied tokens share a rank).
    """

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor


@dataclass
class SamplerOutput:
    """sampled_token_ids: [B] int64. logprobs: None unless some row asked for logprobs; a
    batch gets the largest count any row asked for, and callers keep each row's own count."""

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> [B] int64: the first index of each row's maximum, as ``x.argmax(-1)``.

    torch's CPU argmax over a long row is a scalar loop (~4 ms for 64 x 49k fp32 here) while
    max-reductions are vectorized (~0.4 ms): take the max of each ``ARGMAX_CHUNK`` slice, pick
    the first slice holding the row's max, and take argmax only inside it."""
    B, V = x.shape
    n = V // ARGMAX_CHUNK
    if x.is_cuda or n < 2 or not x.is_contiguous():
        return x.argmax(dim=-1)
    body = x[:, : n * ARGMAX_CHUNK].view(B, n, ARGMAX_CHUNK)
    chunk_max = body.amax(dim=-1)  # [B, n]
    best_max, best_chunk = chunk_max.max(dim=-1)  # first chunk with the max
    rows = torch.arange(B, device=x.device)
    idx = best_chunk * ARGMAX_CHUNK + body[rows, best_chunk].argmax(dim=-1)
    if n * ARGMAX_CHUNK < V:
        tail_max, tail_idx = x[:, n * ARGMAX_CHUNK:].max(dim=-1)
        idx = torch.where(tail_max > best_max, n * ARGMAX_CHUNK + tail_idx, idx)
    return idx


class Sampler(nn.Module):
    """``generator`` draws the noise of unseeded random rows (the engine core's own stream,
    seeded from ``--seed`` and its rank); None uses torch's default generator."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.generator = generator

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V], any float dtype; may be modified in place (the caller's buffer is
        consumed, which saves a [B, V] copy per step)."""
        md = sampling_metadata
        if (
            md.all_greedy
            and md.no_penalties
            and not md.stop_token_ids_to_mask
            and md.max_num_logprobs is None
            and md.logit_bias is None
            and md.allowed_token_mask is None
        ):
            return SamplerOutput(row_argmax(logits), None)

        raw_logprobs = compute_logprobs(logits) if md.max_num_logprobs is not None else None
        logits = logits.to(torch.float32)
        if md.allowed_token_mask is not None:
            rows, banned = md.allowed_token_mask
            logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
        if md.logit_bias is not None:
            rows, ids, biases = md.logit_bias
            logits.index_put_((rows, ids), biases, accumulate=True)
        logits = apply_min_tokens_mask(logits, md.stop_token_ids_to_mask)
        if not md.no_penalties:
            logits = apply_penalties(logits, md)
        sampled = self.sample(logits, md)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logits: [B, V] fp32 after penalties (modified in place) -> [B] int64 token ids."""
        greedy_ids = None
        if not md.all_random:
            greedy_ids = row_argmax(logits)
            if md.all_greedy:
                return greedy_ids

        is_greedy = md.temperature < SAMPLING_EPS
        # Greedy rows also pass through the random path (their result is discarded), so they
        # must not divide by zero.
        temperature = md.temperature
        if not md.all_random:
            temperature = temperature.masked_fill(is_greedy, 1.0)
        logits.div_(temperature.unsqueeze(1))
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k or None)
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        random_ids = random_sample(logits.softmax(dim=-1), md.generators, self.generator)

        if greedy_ids is None:
            return random_ids
        return torch.where(is_greedy, greedy_ids, random_ids)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] logits of any float dtype -> [N, V] fp32 log-probabilities."""
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprob and rank of ``token_ids`` plus the ``num_logprobs`` most likely tokens.

    logprobs: [N, V] fp32; token_ids: [N] -> LogprobsTensors with 1 + num_logprobs columns.
    """
    token_ids = token_ids.to(torch.int64).unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        token_ids = torch.cat((token_ids, top_ids), dim=1)
        token_logprobs = torch.cat((token_logprobs, top_logprobs), dim=1)
    return LogprobsTensors(token_ids, token_logprobs, ranks)


def apply_min_tokens_mask(
    logits: torch.Tensor, stop_token_ids_to_mask: dict[int, list[int]]
) -> torch.Tensor:
    """Set logits[row, id] = -inf for each masked id (in place). logits: [B, V]. A row that
    would have no token left (a grammar that admits only EOS) keeps its stop ids."""
    if not stop_token_ids_to_mask:
        return logits
    rows: list[int] = []
    cols: list[int] = []
    for row, ids in stop_token_ids_to_mask.items():
        rows.extend([row] * len(ids))
        cols.extend(ids)
    index = torch.tensor([rows, cols], dtype=torch.int64, device=logits.device)
    saved = logits[index[0], index[1]]
    logits[index[0], index[1]] = float("-inf")
    masked_rows = torch.tensor(list(stop_token_ids_to_mask), device=logits.device)
    dead = masked_rows[logits[masked_rows].amax(dim=-1) == float("-inf")]
    if dead.numel():
        keep = torch.isin(index[0], dead)
        logits[index[0][keep], index[1][keep]] = saved[keep]
    return logits


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition, then frequency and presence penalties. logits: [B, V] fp32 -> [B, V].

    Repetition divides positive and multiplies negative logits of every token seen in the
    prompt or the output; frequency subtracts penalty * count and presence subtracts penalty
    once, both over output tokens only. Only the seen ids are gathered, updated and scattered
    back, so the work grows with prompt + output length rather than with B * V.
    """
    num_rows, vocab_size = logits.shape
    # A scratch column at index vocab_size absorbs padding and out-of-vocab ids.
    padded = logits.new_empty(num_rows, vocab_size + 1)
    padded[:, :vocab_size] = logits
    output_ids = _output_ids_tensor(md.output_token_ids, vocab_size, logits.device)
    seen_ids = output_ids
    if md.prompt_token_ids is not None:
        seen_ids = torch.cat((md.prompt_token_ids, output_ids), dim=1)

    # A repeated id gathers the same value and so scatters back the same result: the order
    # in which duplicates are written does not matter.
    seen = padded.gather(1, seen_ids)
    repetition = md.repetition_penalties.unsqueeze(1)
    padded.scatter_(1, seen_ids, torch.where(seen > 0, seen / repetition, seen * repetition))

    counts = torch.zeros_like(padded)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=counts.dtype))
    output = padded.gather(1, output_ids)
    output -= md.frequency_penalties.unsqueeze(1) * counts.gather(1, output_ids)
    output -= md.presence_penalties.unsqueeze(1)  # every gathered id occurs at least once
    padded.scatter_(1, output_ids, output)
    return padded[:, :vocab_size]


def _output_ids_tensor(
    output_token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[B, max_len] int64, padded and with out-of-vocab ids (placeholders) set to vocab_size."""
    ids = pad_rows(output_token_ids, pad=vocab_size, device=device)
    return ids.masked_fill_((ids < 0) | (ids >= vocab_size), vocab_size)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Mask (in place, with -inf) tokens outside top-k, then outside top-p. logits: [B, V];
    ``max_top_k``: the largest limited k when the caller knows it (else read from top_k)."""
    if top_k is not None:
        logits = apply_top_k(logits, top_k, max_top_k)
    if top_p is not None:
        logits = apply_top_p(logits, top_p)
    return logits


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor,
                max_k: int | None = None) -> torch.Tensor:
    """Keep (in place) every token whose logit is >= the row's k-th largest, so ties at the
    boundary are all kept. logits: [B, V]; top_k: [B] in [1, V], V meaning no limit;
    ``max_k``: the largest limit below V, if known on the host (reading it from ``top_k``
    waits for the device)."""
    vocab_size = logits.shape[-1]
    limited = top_k < vocab_size
    # A partial top-k up to the largest real limit finds every threshold; rows without a
    # limit would otherwise force a full sort.
    if max_k is None:
        max_k = int(top_k.masked_fill(~limited, 1).max())
    top_values = logits.topk(max_k, dim=-1).values
    kth_largest = top_values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
    kth_largest.masked_fill_(~limited.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth_largest, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor,
                num_candidates: int | None = None) -> torch.Tensor:
    """Keep (in place) the smallest most-likely-first set of tokens whose probability reaches
    top_p: a token is dropped once the tokens before it already sum to top_p. Which of several
    exactly tied tokens at the boundary survives is unspecified. logits: [B, V]; top_p: [B]
    in (0, 1], 1 meaning no limit.

    On a CPU the kept set is almost always far smaller than the vocabulary, so the most likely
    ``num_candidates`` (``TOP_P_CANDIDATES``) go first and only rows whose set does not fit
    are fully sorted; finding those rows reads the device, so on a GPU every row is fully
    sorted at once (``num_candidates`` = V: the same result, no wait for the device).
    """
    vocab_size = logits.shape[-1]
    probs = logits.softmax(dim=-1)
    if num_candidates is None:
        num_candidates = vocab_size if logits.is_cuda else TOP_P_CANDIDATES
    num_candidates = min(vocab_size, num_candidates)
    candidate_probs, candidate_ids = probs.topk(num_candidates, dim=-1)
    keep_candidates, resolved = _top_p_keep_sorted(candidate_probs, top_p)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep.scatter_(1, candidate_ids, keep_candidates)
    if num_candidates < vocab_size and not bool(resolved.all()):
        rows = (~resolved).nonzero().squeeze(1)
        sorted_probs, sorted_ids = probs[rows].sort(dim=-1, descending=True)
        keep_sorted, _ = _top_p_keep_sorted(sorted_probs, top_p[rows])
        keep[rows] = torch.zeros_like(keep[rows]).scatter_(1, sorted_ids, keep_sorted)
    # Rows at top_p = 1 keep everything: rounding could push the sum to 1 early and cut the
    # tail.
    keep |= (top_p >= 1.0).unsqueeze(1)
    return logits.masked_fill_(~keep, float("-inf"))


def _top_p_keep_sorted(
    sorted_probs: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """sorted_probs: [R, C] descending (all or a prefix of each row); top_p: [R].

    Returns keep [R, C] bool, and resolved [R] bool: whether the prefix reaches top_p, so
    that every token outside it is dropped.
    """
    cumulative = sorted_probs.cumsum(dim=-1)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    keep[:, 1:] = cumulative[:, :-1] < top_p.unsqueeze(1)
    resolved = (cumulative[:, -1] >= top_p) | (top_p >= 1.0)
    return keep, resolved


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (in place) tokens with prob < min_p * max prob. logits: [B, V]; min_p: [B]."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                  default_generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample one token per row of probs [B, V] (consumed) -> [B] int64.

    argmax(probs / q) with q ~ Exponential(1) picks token i with probability probs[i]. A
    seeded row draws its whole q row from its own generator, so its tokens do not depend on
    the rest of the batch; the other rows share one draw from ``default_generator`` (torch's
    default one when None).
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        fill_exponential_(q, default_generator)
    for row, generator in generators.items():
        fill_exponential_(q[row], generator)
    return row_argmax(probs.div_(q))


def fill_exponential_(q: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill q (any shape) in place with Exponential(1) draws from ``generator``.

    -log(u) with u ~ U[0, 1) is several times cheaper on CPU than ``exponential_()``. u < 1
    keeps q > 0, so probs / q is never 0/0; u = 0 gives q = inf, a token that cannot win.
    """
    return q.uniform_(generator=generator).log_().neg_()
