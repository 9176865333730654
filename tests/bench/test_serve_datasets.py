"""Prompts of ``widellm bench serve``: random (token ids or text), ShareGPT from a local file,
prefix repetition; and how the timed and untimed prompts of a run are split."""

import json
from collections import Counter

import numpy as np
import pytest

from tests.bench.bench_utils import parse_bench_args, word_level_tokenizer
from widellm.bench.datasets import (
    DECODE_RETRIES,
    ids_to_text,
    prefix_repetition_samples,
    random_samples,
    random_token_prompts,
    sample_lengths,
    sharegpt_samples,
)
from widellm.bench.serve import build_samples
from widellm.bench.serve_args import resolve_args
from widellm.engine.tokenizer import get_tokenizer

VOCAB = 300


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("word_tokenizer")
    word_level_tokenizer(path, VOCAB)
    return get_tokenizer(str(path))


def _words(ids) -> str:
    return " ".join(f"t{i}" for i in ids)


def test_random_token_ids_match_the_shared_list_and_grow_without_changing():
    samples = random_samples(3, input_len=5, output_len=7, seed=7, vocab_size=VOCAB,
                             as_text=False)
    assert [s.prompt for s in samples] == random_token_prompts(3, 5, VOCAB, seed=7)
    assert [(s.prompt_len, s.output_len) for s in samples] == [(5, 7)] * 3
    # Sample i is the same however many follow it, also with varied lengths.
    kwargs = dict(input_len=20, output_len=10, seed=1, vocab_size=VOCAB, as_text=False,
                  range_ratio=0.5, prefix_len=3)
    assert random_samples(4, **kwargs) == random_samples(9, **kwargs)[:4]


def test_random_lengths_follow_the_range_ratio_and_share_the_prefix():
    samples = random_samples(200, input_len=20, output_len=10, seed=2, vocab_size=VOCAB,
                             as_text=False, range_ratio=0.5, prefix_len=4)
    assert {s.prompt_len - 4 for s in samples} == set(range(10, 31))
    assert {s.output_len for s in samples} == set(range(5, 16))
    assert len({tuple(s.prompt[:4]) for s in samples}) == 1
    assert len({tuple(s.prompt[4:]) for s in samples}) == 200
    with pytest.raises(ValueError, match="range-ratio"):
        sample_lengths(2, 10, 1.0, np.random.default_rng(0))
    # Output lengths never reach 0.
    assert min(sample_lengths(50, 1, 0.9, np.random.default_rng(0), minimum=1)) == 1


def test_random_text_prompts_decode_the_same_ids(tokenizer):
    samples = random_samples(3, input_len=6, output_len=2, seed=4, tokenizer=tokenizer)
    ids = random_token_prompts(3, 6, VOCAB, seed=4)
    assert [s.prompt for s in samples] == [_words(p) for p in ids]
    assert [s.prompt_len for s in samples] == [6, 6, 6]
    with pytest.raises(ValueError, match="tokenizer"):
        random_samples(1, input_len=6, output_len=2, seed=4, vocab_size=VOCAB)


class _HalvingTokenizer:
    """Every two characters of text are one token, and every token decodes to one 'x':
    re-encoding always halves the length, so no text has the asked-for length."""

    def __len__(self):
        return VOCAB

    def decode(self, ids):
        return "x" * len(ids)

    def encode(self, text, add_special_tokens=False):
        return [1] * ((len(text) + 1) // 2)


def test_text_that_never_fits_reports_its_true_length():
    text, length = ids_to_text(_HalvingTokenizer(), list(range(100, 110)),
                               np.random.default_rng(0))
    assert (text, length) == ("x" * 10, 5)
    assert DECODE_RETRIES > 1


def _sharegpt_file(path, conversations) -> str:
    data = [{"id": str(i), "conversations": [{"from": f, "value": v} for f, v in turns]}
            for i, turns in enumerate(conversations)]
    data.append({"id": "no-turns"})
    path.write_text(json.dumps(data))
    return str(path)


SHAREGPT = [
    [("human", "t1 t2 t3 t4 t5"), ("gpt", "t6 t7 t8 t9")],
    [("human", "t10 t11 t12 t13 t14 t15"), ("gpt", "t16 t17 t18 t19 t20")],
    [("human", "t21 t22"), ("gpt", "t23 t24 t25 t26")],  # prompt too short: dropped
    [("human", "t30 t31 t32 t33")],                       # one turn: dropped
    [("human", "t40 t41 t42 t43"), ("gpt", "t44")],       # reply too short: dropped
]


def test_sharegpt_reads_a_local_file(tokenizer, tmp_path):
    path = _sharegpt_file(tmp_path / "sg.json", SHAREGPT)
    samples = sharegpt_samples(path, 2, tokenizer, seed=0, shuffle=False)
    assert [(s.prompt, s.prompt_len, s.output_len) for s in samples] == [
        ("t1 t2 t3 t4 t5", 5, 4), ("t10 t11 t12 t13 t14 t15", 6, 5)]
    # A fixed output length also admits the short reply; more prompts than usable
    # conversations repeat them, unless told not to.
    samples = sharegpt_samples(path, 5, tokenizer, seed=0, output_len=3)
    assert {s.prompt for s in samples} == {"t1 t2 t3 t4 t5", "t10 t11 t12 t13 t14 t15",
                                           "t40 t41 t42 t43"}
    assert len(samples) == 5 and {s.output_len for s in samples} == {3}
    with pytest.raises(ValueError, match="no-oversample"):
        sharegpt_samples(path, 5, tokenizer, seed=0, oversample=False)
    shuffled = [s.prompt for s in sharegpt_samples(path, 2, tokenizer, seed=3)]
    assert shuffled == [s.prompt for s in sharegpt_samples(path, 2, tokenizer, seed=3)]


def test_sharegpt_run_splits_timed_and_untimed(tokenizer, tmp_path):
    path = _sharegpt_file(tmp_path / "sg.json", SHAREGPT)
    args = parse_bench_args("--dataset-name", "sharegpt", "--dataset-path", path,
                            "--num-prompts", "1", "--disable-shuffle", "--output-len", "9")
    timed, untimed = build_samples(resolve_args(args), tokenizer, num_untimed=1)
    assert [s.prompt for s in timed] == ["t1 t2 t3 t4 t5"]
    assert [s.prompt for s in untimed] == ["t10 t11 t12 t13 t14 t15"]
    assert timed[0].output_len == 9  # --output-len sets --sharegpt-output-len


def test_prefix_repetition_gives_exactly_num_prompts(tokenizer):
    samples = prefix_repetition_samples(7, tokenizer, prefix_len=4, suffix_len=3,
                                        num_prefixes=3, output_len=5, seed=0)
    assert len(samples) == 7
    assert {(s.prompt_len, s.output_len) for s in samples} == {(7, 5)}
    prefixes = Counter(" ".join(s.prompt.split()[:4]) for s in samples)
    assert sorted(prefixes.values()) == [2, 2, 3]
    assert len({s.prompt for s in samples}) == 7
    with pytest.raises(ValueError, match="num-prefixes"):
        prefix_repetition_samples(2, tokenizer, prefix_len=4, suffix_len=3, num_prefixes=3,
                                  output_len=5, seed=0)


def test_prefix_repetition_run_warms_up_on_other_prompts(tokenizer):
    args = resolve_args(parse_bench_args(
        "--dataset-name", "prefix-repetition", "--num-prompts", "4",
        "--prefix-repetition-prefix-len", "6", "--prefix-repetition-suffix-len", "2",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3"))
    assert args.dataset_name == "prefix_repetition"  # vLLM's spelling
    timed, untimed = build_samples(args, tokenizer, num_untimed=2)
    assert len(timed) == 4 and len(untimed) == 2
    timed_prefixes = {" ".join(s.prompt.split()[:6]) for s in timed}
    assert len(timed_prefixes) == 2
    assert all(" ".join(s.prompt.split()[:6]) not in timed_prefixes for s in untimed)
    assert {(s.prompt_len, s.output_len) for s in untimed} == {(8, 3)}
