"""Benchmark prompts, named as in ``vllm bench serve``.

* ``random``: token ids drawn from a fixed seed, the same on every engine (the vLLM and
  transformers scripts in benchmarks/ build the identical list). Sent as the ids themselves
  (a widellm extra), or, by default, decoded to text and re-encoded until the text is the
  wanted number of tokens, as vLLM does.
* ``sharegpt``: the first human turn of each conversation in a local ShareGPT JSON file.
* ``prefix_repetition``: ``num_prefixes`` shared prefixes, each followed by random suffixes,
  to measure prefix caching.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import numpy as np

# Stay clear of the low ids where special tokens usually live, and of the very top of the
# vocabulary where some tokenizers keep added tokens.
TOKEN_ID_MARGIN = 100
# Decode/re-encode rounds before a text prompt keeps whatever length it has (vLLM's count).
DECODE_RETRIES = 10
# ShareGPT pruning, as in vLLM: too-short turns say nothing, too-long ones overflow contexts.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to send: token ids or text, its length in tokens, and the tokens to ask
    for (None: the caller's default)."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int | None = None


def _id_bounds(vocab_size: int) -> tuple[int, int]:
    low, high = TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN
    return (low, high) if high > low else (0, vocab_size)


def random_token_prompts(
    num_prompts: int, input_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """num_prompts lists of input_len ids in [TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN)."""
    low, high = _id_bounds(vocab_size)
    rng = np.random.RandomState(seed)
    return rng.randint(low, high, size=(num_prompts, input_len)).tolist()


def sample_lengths(num: int, mean: int, range_ratio: float, rng: np.random.Generator,
                   minimum: int = 0) -> list[int]:
    """``num`` lengths uniform in [floor(mean * (1 - r)), ceil(mean * (1 + r))] (vLLM's
    ``--random-range-ratio``), never below ``minimum``; all ``mean`` when r is 0."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if range_ratio == 0.0:
        return [max(mean, minimum)] * num
    low = max(int(np.floor(mean * (1 - range_ratio))), minimum)
    high = max(int(np.ceil(mean * (1 + range_ratio))), low)
    return rng.integers(low, high + 1, size=num).tolist()


def ids_to_text(tokenizer, ids: list[int], pad: np.random.Generator) -> tuple[str, int]:
    """Text that re-encodes to ``len(ids)`` tokens where the tokenizer allows: decoding then
    encoding can merge or split tokens, so the ids are re-encoded, cut or padded with random
    ids, and decoded again, up to DECODE_RETRIES times. Returns the text and its true length."""
    target = len(ids)
    low, high = _id_bounds(len(tokenizer))
    for _ in range(DECODE_RETRIES):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            return text, target
        ids = (ids[:target] if len(ids) > target
               else ids + pad.integers(low, high, size=target - len(ids)).tolist())
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def random_samples(
    num: int, *, input_len: int, output_len: int, seed: int, range_ratio: float = 0.0,
    prefix_len: int = 0, vocab_size: int | None = None, tokenizer=None, as_text: bool = True,
) -> list[SampleRequest]:
    """The ``random`` dataset: a shared prefix of ``prefix_len`` ids, then ids drawn from
    ``seed``. Sample i is the same whatever ``num`` is, so extra untimed samples can be drawn
    after the timed ones. With ``range_ratio`` 0 and no prefix, the ids are exactly
    ``random_token_prompts(num, input_len, vocab_size, seed)``."""
    vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
    if as_text and tokenizer is None:
        raise ValueError("text prompts need a tokenizer (pass --tokenizer)")
    # One stream each for input lengths, output lengths and padding, so sample i does not
    # depend on ``num`` and text prompts draw the same ids as token-id ones.
    in_rng, out_rng, pad = (np.random.default_rng(s)
                            for s in np.random.SeedSequence(seed).spawn(3))
    input_lens = sample_lengths(num, input_len, range_ratio, in_rng)
    output_lens = sample_lengths(num, output_len, range_ratio, out_rng, minimum=1)
    if prefix_len + min(input_lens, default=1) < 1:
        raise ValueError("prompts would be empty: raise --random-input-len or "
                         "--random-prefix-len, or lower --random-range-ratio")
    low, high = _id_bounds(vocab_size)
    ids_rng = np.random.RandomState(seed)
    prefix = ids_rng.randint(low, high, size=prefix_len).tolist()
    # One flat draw split by length: equal lengths give random_token_prompts' exact ids.
    flat = ids_rng.randint(low, high, size=sum(input_lens)).tolist()
    samples, start = [], 0
    for in_len, out_len in zip(input_lens, output_lens):
        ids = prefix + flat[start:start + in_len]
        start += in_len
        if as_text:
            text, prompt_len = ids_to_text(tokenizer, ids, pad)
            samples.append(SampleRequest(text, prompt_len, out_len))
        else:
            samples.append(SampleRequest(ids, len(ids), out_len))
    return samples


def _valid_sharegpt_pair(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    return (SHAREGPT_MIN_LEN <= prompt_len <= SHAREGPT_MAX_PROMPT_LEN
            and (fixed_output or output_len >= SHAREGPT_MIN_LEN)
            and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN)


def sharegpt_samples(
    path: str, num: int, tokenizer, *, seed: int, output_len: int | None = None,
    shuffle: bool = True, oversample: bool = True,
) -> list[SampleRequest]:
    """The ``sharegpt`` dataset from a local JSON file (a list of ``{"conversations":
    [{"from": ..., "value": ...}, ...]}``): each conversation's first turn is the prompt and
    the second's token count the output length (``output_len`` overrides it). Conversations
    are shuffled with ``seed``; when the file has fewer usable ones than ``num``, random
    ones are repeated unless ``oversample`` is off."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file holds a JSON list of conversations")
    entries = [e for e in data if isinstance(e, dict) and len(e.get("conversations") or []) >= 2]
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(entries)
    samples: list[SampleRequest] = []
    for entry in entries:
        if len(samples) >= num:
            break
        prompt, completion = (turn["value"] for turn in entry["conversations"][:2])
        prompt_len = len(tokenizer(prompt).input_ids)
        out_len = output_len if output_len is not None else len(tokenizer(completion).input_ids)
        if _valid_sharegpt_pair(prompt_len, out_len, output_len is not None):
            samples.append(SampleRequest(prompt, prompt_len, out_len))
    if not samples:
        raise ValueError(f"{path} holds no usable conversation (two turns, a prompt of "
                         f"{SHAREGPT_MIN_LEN}-{SHAREGPT_MAX_PROMPT_LEN} tokens)")
    if len(samples) < num:
        if not oversample:
            raise ValueError(f"{path} has {len(samples)} usable conversations, fewer than "
                             f"the {num} prompts asked for (drop --no-oversample to repeat)")
        samples += rng.choices(samples, k=num - len(samples))
    return samples


def prefix_repetition_samples(
    num: int, tokenizer, *, prefix_len: int, suffix_len: int, num_prefixes: int,
    output_len: int, seed: int, shuffle: bool = True,
) -> list[SampleRequest]:
    """The ``prefix_repetition`` dataset: ``num_prefixes`` random prefixes of ``prefix_len``
    tokens, each followed by random suffixes of ``suffix_len`` tokens, shuffled. Unlike
    vLLM, which drops ``num % num_prefixes`` prompts, the first prefixes take one prompt more
    so there are exactly ``num``."""
    if not 0 < num_prefixes <= num:
        raise ValueError(f"--prefix-repetition-num-prefixes must be in [1, --num-prompts "
                         f"({num})], got {num_prefixes}")
    low, high = _id_bounds(len(tokenizer))
    rng = np.random.default_rng(seed)

    def exact_ids(length: int) -> list[int]:
        _, ids = _fit_ids(tokenizer, rng.integers(low, high, size=length).tolist(), rng)
        return ids

    samples = []
    per_prefix, extra = divmod(num, num_prefixes)
    for i in range(num_prefixes):
        prefix = exact_ids(prefix_len)
        for _ in range(per_prefix + (i < extra)):
            ids = prefix + exact_ids(suffix_len)
            samples.append(SampleRequest(tokenizer.decode(ids), len(ids), output_len))
    if shuffle:
        random.Random(seed).shuffle(samples)
    return samples


def _fit_ids(tokenizer, ids: list[int], pad: np.random.Generator) -> tuple[str, list[int]]:
    """``ids_to_text``, returning the re-encoded ids instead of their count."""
    text, _ = ids_to_text(tokenizer, ids, pad)
    return text, tokenizer.encode(text, add_special_tokens=False)
