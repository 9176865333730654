"""What the sampler needs to know about one step's batch, as tensors it can use directly."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from widellm.sampling_params import SAMPLING_EPS, SamplingParams
from widellm.worker.input_batch import CachedRequestState

# Values that make a filter or penalty a no-op for a row that does not use it, so a batch can
# apply it to every row at once.
NO_TOP_P = 1.0
NO_MIN_P = 0.0
NO_PRESENCE_PENALTY = 0.0
NO_FREQUENCY_PENALTY = 0.0
NO_REPETITION_PENALTY = 1.0


@dataclass
class SamplingMetadata:
    """Sampling settings for B rows, one per request sampled this step.

    A field that no row uses is ``None`` (or empty) so the sampler can skip that work;
    otherwise rows that do not use it hold a neutral value.

    temperature: [B] fp32; 0 for greedy rows.
    all_greedy / all_random: every row is greedy / no row is.
    top_k: [B] int64 in [1, vocab_size]; vocab_size for rows without top-k.
    max_top_k: the largest limit of a row with top-k (known on the host, so the sampler
        need not read ``top_k`` back from the device); 0 without top-k.
    top_p: [B] fp32; 1.0 for rows without top-p.
    min_p: [B] fp32; 0.0 for rows without min-p.
    generators: row -> that request's own generator, for seeded rows.
    presence_penalties / frequency_penalties / repetition_penalties: [B] fp32, all three
        ``None`` when no row uses any penalty; neutral rows hold 0, 0 and 1.
    output_token_ids: tokens generated so far, per row (for penalties). Ids outside
        [0, vocab_size), such as async-scheduling placeholders, are ignored.
    prompt_token_ids: [B, P] int64 padded with vocab_size, set only when some row has a
        repetition penalty (which, as in HF and vLLM, also counts prompt tokens); rows without
        one are all padding.
    stop_token_ids_to_mask: row -> token ids forced to -inf because the row has produced
        fewer than ``min_tokens`` tokens.
    max_num_logprobs: the largest ``logprobs`` of any row, ``None`` when no row asks.
    logit_bias: (rows [N] int64, token ids [N] int64, biases [N] fp32) of every row's
        ``logit_bias`` entries, ``None`` when no row has one.
    allowed_token_mask: (rows [R] int64, banned [R, vocab_size] bool) of the rows with
        ``allowed_token_ids``: True where a token is not allowed; ``None`` when no row has
        them.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    output_token_ids: list[list[int]]
    prompt_token_ids: torch.Tensor | None
    stop_token_ids_to_mask: dict[int, list[int]]
    max_num_logprobs: int | None
    max_top_k: int = 0
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    allowed_token_mask: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def no_penalties(self) -> bool:
        return self.presence_penalties is None

    @classmethod
    def for_requests(cls, states: Sequence[CachedRequestState],
                     generators: dict[str, torch.Generator], vocab_size: int,
                     device: torch.device | str = "cpu") -> SamplingMetadata:
        """The metadata of rows sampling for ``states`` (in row order), with the seeded
        requests' own generators, its tensors on ``device``."""
        return cls.build(
            [s.sampling_params for s in states],
            [s.output_token_ids for s in states],
            vocab_size,
            generators={j: generators[s.req_id] for j, s in enumerate(states)
                        if s.req_id in generators},
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in states],
            eos_token_ids=[s.eos_token_ids for s in states],
            device=device,
        )

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        output_token_ids: list[list[int]],
        vocab_size: int,
        generators: dict[int, torch.Generator] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Sequence[Collection[int]] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Make the metadata for one step from per-row lists (all indexed by row).

        generators: row -> generator for seeded rows (the caller owns them, one per request,
            so their state carries over from step to step).
        prompt_token_ids: needed only if some row has a repetition penalty.
        eos_token_ids: per-row EOS ids, masked like stop tokens under ``min_tokens`` unless
            the row ignores EOS.
        """
        num_rows = len(params_list)
        if len(output_token_ids) != num_rows:
            raise ValueError(
                f"output_token_ids has {len(output_token_ids)} rows, expected {num_rows}"
            )

        temperatures = [
            p.temperature if p.temperature >= SAMPLING_EPS else 0.0 for p in params_list
        ]
        num_greedy = sum(t == 0.0 for t in temperatures)

        def float_tensor(values: list[float]) -> torch.Tensor:
            return host_to_device(values, torch.float32, device)

        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params_list]
        top_ps = [p.top_p for p in params_list]
        min_ps = [p.min_p for p in params_list]

        presence = [p.presence_penalty for p in params_list]
        frequency = [p.frequency_penalty for p in params_list]
        repetition = [p.repetition_penalty for p in params_list]
        uses_repetition = any(r != NO_REPETITION_PENALTY for r in repetition)
        uses_penalties = (
            uses_repetition
            or any(v != NO_PRESENCE_PENALTY for v in presence)
            or any(v != NO_FREQUENCY_PENALTY for v in frequency)
        )

        prompt_tensor = None
        if uses_repetition:
            if prompt_token_ids is None:
                raise ValueError("prompt_token_ids is required when a row has a repetition_penalty")
            # Only rows with a repetition penalty read the prompt; the rest stay padding.
            prompt_rows = [
                prompt_token_ids[i] if r != NO_REPETITION_PENALTY else ()
                for i, r in enumerate(repetition)
            ]
            prompt_tensor = pad_rows(prompt_rows, pad=vocab_size, device=device)

        logprob_counts = [p.logprobs for p in params_list if p.logprobs is not None]

        return cls(
            temperature=float_tensor(temperatures),
            all_greedy=num_greedy == num_rows,
            all_random=num_greedy == 0,
            top_k=(
                host_to_device(top_ks, torch.int64, device)
                if any(k < vocab_size for k in top_ks) else None
            ),
            top_p=float_tensor(top_ps) if any(p < NO_TOP_P for p in top_ps) else None,
            min_p=float_tensor(min_ps) if any(p > NO_MIN_P for p in min_ps) else None,
            generators={} if generators is None else generators,
            presence_penalties=float_tensor(presence) if uses_penalties else None,
            frequency_penalties=float_tensor(frequency) if uses_penalties else None,
            repetition_penalties=float_tensor(repetition) if uses_penalties else None,
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_tensor,
            stop_token_ids_to_mask=_min_tokens_masks(
                params_list, output_token_ids, eos_token_ids, vocab_size
            ),
            max_num_logprobs=max(logprob_counts) if logprob_counts else None,
            max_top_k=max((k for k in top_ks if k < vocab_size), default=0),
            logit_bias=_logit_bias(params_list, device),
            allowed_token_mask=_allowed_token_mask(params_list, vocab_size, device),
        )


def _logit_bias(params_list: Sequence[SamplingParams], device: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    biases: list[float] = []
    for row, params in enumerate(params_list):
        for token_id, bias in (params.logit_bias or {}).items():
            rows.append(row)
            ids.append(token_id)
            biases.append(bias)
    if not rows:
        return None
    return (host_to_device(rows, torch.int64, device),
            host_to_device(ids, torch.int64, device),
            host_to_device(biases, torch.float32, device))


def _allowed_token_mask(params_list: Sequence[SamplingParams], vocab_size: int,
                        device: torch.device | str
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = [row for row, p in enumerate(params_list) if p.allowed_token_ids is not None]
    if not rows:
        return None
    banned = torch.ones(len(rows), vocab_size, dtype=torch.bool)
    for i, row in enumerate(rows):
        banned[i, params_list[row].allowed_token_ids] = False
    return host_to_device(rows, torch.int64, device), banned.to(device, non_blocking=True)


def pad_rows(
    rows: Sequence[Sequence[int]], pad: int, device: torch.device | str
) -> torch.Tensor:
    """[B, max_len] int64 of ``rows``, right-padded with ``pad``."""
    width = max((len(r) for r in rows), default=0)
    padded = [list(r) + [pad] * (width - len(r)) for r in rows]
    return host_to_device(padded, torch.int64, device).reshape(len(rows), width)


def _min_tokens_masks(
    params_list: Sequence[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: Sequence[Collection[int]] | None,
    vocab_size: int,
) -> dict[int, list[int]]:
    """row -> stop ids the row may not sample yet; ids outside the vocab cannot be sampled."""
    masks: dict[int, list[int]] = {}
    for row, params in enumerate(params_list):
        if len(output_token_ids[row]) >= params.min_tokens:
            continue
        stop_ids = set(params.all_stop_token_ids)
        if eos_token_ids is not None and not params.ignore_eos:
            stop_ids.update(eos_token_ids[row])
        ids = sorted(t for t in stop_ids if 0 <= t < vocab_size)
        if ids:
            masks[row] = ids
    return masks


def host_to_device(values: Sequence, dtype: torch.dtype,
                   device: torch.device | str) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without waiting for the device's queued
    work (a blocking copy would wait for the step's forward; pageable memory is staged by the
    driver before the call returns, so the list can go)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
