"""The sampler's batched ops against hand-computed values and their per-row reference twins:
the metadata it builds, greedy and penalised argmax, and the top-k / top-p / min-p filters.
Seeded sampling, logprobs and the rest are in ``test_sampler_rows.py``."""

import pytest
import torch

from tests.worker.sampler_cases import build, random_ids, sample, seeded
from widellm.sampling_params import SamplingParams
from widellm.worker.sampler import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    TOP_P_CANDIDATES,
)
from widellm.worker.sampler_reference import (
    reference_apply_penalties_row,
    reference_filter_row,
)


def test_build_leaves_unused_features_empty():
    md = build([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)], vocab_size=8)
    assert md.all_greedy and not md.all_random
    assert torch.equal(md.temperature, torch.zeros(2))
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.no_penalties and md.repetition_penalties is None and md.prompt_token_ids is None
    assert md.stop_token_ids_to_mask == {} and md.max_num_logprobs is None
    assert md.logit_bias is None and md.allowed_token_mask is None


def test_build_neutral_values_for_rows_without_a_feature():
    params = [
        SamplingParams(top_k=3, logprobs=2),
        SamplingParams(top_p=0.5, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(min_p=0.25, top_k=100, presence_penalty=0.5),
    ]
    md = build(params, vocab_size=10, prompts=[[1, 2, 3], [4, 5], [6], [7, 8, 9, 0]])
    assert not md.all_greedy and not md.all_random
    assert torch.equal(md.temperature, torch.tensor([1.0, 1.0, 0.0, 1.0]))
    # top_k larger than the vocab is the same as no top_k.
    assert torch.equal(md.top_k, torch.tensor([3, 10, 10, 10]))
    assert torch.equal(md.top_p, torch.tensor([1.0, 0.5, 1.0, 1.0]))
    assert torch.equal(md.min_p, torch.tensor([0.0, 0.0, 0.0, 0.25]))
    assert torch.equal(md.presence_penalties, torch.tensor([0.0, 0.0, 0.0, 0.5]))
    assert torch.equal(md.frequency_penalties, torch.zeros(4))
    assert torch.equal(md.repetition_penalties, torch.tensor([1.0, 1.5, 1.0, 1.0]))
    # Only the repetition-penalty row keeps its prompt; padding is vocab_size.
    assert torch.equal(md.prompt_token_ids, torch.tensor([[10, 10], [4, 5], [10, 10], [10, 10]]))
    assert md.max_num_logprobs == 5


def test_build_requires_prompt_for_repetition_penalty():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        build([SamplingParams(repetition_penalty=1.2)], vocab_size=4)


def test_build_min_tokens_masks():
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[5, 2, 99]),
        SamplingParams(min_tokens=3, stop_token_ids=[5]),
        SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(min_tokens=2, stop_token_ids=[5]),
    ]
    outputs = [[1, 1], [1], [1], [1, 1]]
    md = build(params, vocab_size=8, outputs=outputs, eos=[{7}, {7}, {7}, {7}])
    # Row 0: out-of-vocab 99 dropped; row 2 ignores EOS; row 3 has reached min_tokens.
    assert md.stop_token_ids_to_mask == {0: [2, 5, 7], 1: [5, 7], 2: [5]}


# ---- greedy ----------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=seeded(0))
    logits[5, 7] = logits[5, 30] = logits[5].max() + 1.0  # a tie: first index wins
    out = sample(logits, build([SamplingParams(temperature=0.0)] * 6, vocab_size=50))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids[5].item() == 7
    assert out.logprobs is None


def test_greedy_in_mixed_batch_uses_penalised_argmax():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0], [0.0, 0.0, 5.0, 0.0]])
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, top_k=1),
    ]
    md = build(params, vocab_size=4, outputs=[[0], [3]])
    out = sample(logits, md)
    # Row 0: token 0 drops to 1.5, below token 1; row 1: top_k=1 leaves only token 2.
    assert out.sampled_token_ids.tolist() == [1, 2]


# ---- penalties -------------------------------------------------------------------------


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    # -1 is an async-scheduling placeholder and must be ignored.
    md = build(params, vocab_size=5, outputs=[[3, 3, 1, -1], [0, 1]], prompts=[[0, 4], [2]])
    got = apply_penalties(logits.clone(), md)
    # Row 0: repetition on seen {0, 1, 3, 4}: 2/2=1, -1*2=-2, 3/2=1.5, -2*2=-4; then token 3
    # (count 2): 1.5 - 0.5*2 - 0.25 = 0.25; token 1 (count 1): -2 - 0.5 - 0.25 = -2.75.
    expected = torch.tensor([[1.0, -2.75, 0.5, 0.25, -4.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    assert torch.equal(got, expected)
    for row in range(2):
        ref = reference_apply_penalties_row(
            logits[row], params[row], [[0, 4], [2]][row], [[3, 3, 1, -1], [0, 1]][row]
        )
        assert torch.equal(ref, expected[row])


def test_penalties_match_reference():
    gen = seeded(1)
    vocab_size, num_rows = 40, 6
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 3
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=-0.7, presence_penalty=1.1),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=0.3, presence_penalty=-0.4),
        SamplingParams(presence_penalty=2.0),
        SamplingParams(repetition_penalty=1.7, frequency_penalty=1.9),
    ]
    prompts = [random_ids(gen, vocab_size, n) for n in (5, 0, 9, 3, 7, 12)]
    outputs = [random_ids(gen, vocab_size, n) for n in (8, 15, 0, 4, 1, 20)]
    md = build(params, vocab_size, outputs=outputs, prompts=prompts)
    got = apply_penalties(logits.clone(), md)
    for row in range(num_rows):
        ref = reference_apply_penalties_row(logits[row], params[row], prompts[row], outputs[row])
        torch.testing.assert_close(got[row], ref, rtol=0.0, atol=1e-6)
    assert torch.equal(got[2], logits[2])


# ---- top-k / top-p / min-p --------------------------------------------------------------

FIVE_PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


@pytest.mark.parametrize(
    ("kwargs", "kept"),
    [
        ({}, [0, 1, 2, 3, 4]),
        ({"top_k": 1}, [0]),
        ({"top_k": 2}, [0, 1]),
        ({"top_p": 0.35}, [0]),
        ({"top_p": 0.6}, [0, 1]),
        ({"top_p": 0.75}, [0, 1, 2]),
        ({"min_p": 0.3}, [0, 1, 2]),  # threshold 0.12
        ({"min_p": 0.5}, [0, 1]),  # threshold 0.2
        # top-k leaves 4 tokens (cumulative 0.42, 0.74, 0.89 of 0.95, all below 0.9), then
        # min-p drops token 3 (0.1 < 0.3 * 0.4).
        ({"top_k": 4, "top_p": 0.9, "min_p": 0.3}, [0, 1, 2]),
        ({"top_k": 3, "top_p": 0.5}, [0, 1]),
    ],
)
def test_filters_on_five_tokens(kwargs, kept):
    # Shuffle the token order so ids differ from ranks.
    perm = torch.tensor([3, 0, 4, 1, 2])
    logits = torch.empty(5)
    logits[perm] = torch.tensor(FIVE_PROBS).log()
    params = SamplingParams(**kwargs)
    md = build([params, SamplingParams()], vocab_size=5)
    batch = logits.repeat(2, 1)
    filtered = apply_top_k_top_p(batch, md.top_k, md.top_p)
    if md.min_p is not None:
        filtered = apply_min_p(filtered, md.min_p)
    expected = torch.zeros(5, dtype=torch.bool)
    expected[perm[kept]] = True
    assert torch.equal(filtered[0].isfinite(), expected)
    assert torch.equal(filtered[1], logits)  # the unfiltered row is untouched
    assert torch.equal(reference_filter_row(logits, params), expected)


def test_top_k_keeps_ties_at_boundary():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    md = build([SamplingParams(top_k=2)], vocab_size=5)
    filtered = apply_top_k_top_p(logits.clone(), md.top_k, None)
    assert filtered[0].isfinite().tolist() == [False, True, True, True, False]


def test_min_p_keeps_tokens_exactly_at_threshold():
    logits = torch.tensor([[0.0, 0.0, -1.0, 0.0]])
    filtered = apply_min_p(logits.clone(), torch.tensor([1.0]))
    assert filtered[0].isfinite().tolist() == [True, True, False, True]


def test_top_p_stops_once_mass_is_reached_exactly():
    # Four tokens of exactly 0.25: two reach 0.5, so the third is dropped.
    md = build([SamplingParams(top_p=0.5)], vocab_size=4)
    filtered = apply_top_k_top_p(torch.zeros(1, 4), None, md.top_p)
    assert filtered[0].isfinite().sum().item() == 2


def test_top_p_one_keeps_the_tail_next_to_a_filtered_row():
    # Many tiny tokens: rounding in the cumulative sum must not cut them when top_p = 1.
    logits = torch.cat([torch.tensor([20.0]), torch.zeros(999)]).repeat(2, 1)
    md = build([SamplingParams(top_p=0.5), SamplingParams(top_p=1.0)], vocab_size=1000)
    filtered = apply_top_k_top_p(logits, None, md.top_p)
    assert filtered[0].isfinite().sum().item() == 1
    assert filtered[1].isfinite().all()


def test_top_p_falls_back_to_full_sort_for_wide_rows():
    # A flat row keeps far more than TOP_P_CANDIDATES tokens; a peaked row fits in them.
    vocab_size = 3 * TOP_P_CANDIDATES
    gen = seeded(4)
    flat = torch.randn(vocab_size, generator=gen) * 0.1
    peaked = torch.randn(vocab_size, generator=gen) * 4
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.8), SamplingParams(top_p=0.9)]
    logits = torch.stack([flat, peaked, flat])
    md = build(params, vocab_size)
    filtered = apply_top_k_top_p(logits.clone(), md.top_k, md.top_p)
    num_kept = filtered.isfinite().sum(dim=-1).tolist()
    assert num_kept[0] > TOP_P_CANDIDATES and num_kept[1] < TOP_P_CANDIDATES
    for row, p in enumerate(params):
        assert torch.equal(filtered[row].isfinite(), reference_filter_row(logits[row], p)), row


def test_filters_match_reference():
    gen = seeded(2)
    vocab_size = 64
    params = [
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.8, temperature=0.6),
        SamplingParams(min_p=0.1, temperature=1.4),
        SamplingParams(top_k=20, top_p=0.7, min_p=0.05),
        SamplingParams(top_k=1),
        SamplingParams(),
        SamplingParams(top_p=0.95, min_p=0.3, temperature=0.9),
        SamplingParams(top_k=40, top_p=0.3),
    ]
    logits = torch.randn(len(params), vocab_size, generator=gen) * 2
    md = build(params, vocab_size)
    scaled = logits / md.temperature.unsqueeze(1)
    filtered = apply_min_p(apply_top_k_top_p(scaled, md.top_k, md.top_p), md.min_p)
    for row, p in enumerate(params):
        assert torch.equal(filtered[row].isfinite(), reference_filter_row(logits[row], p)), row


# ---- random sampling -------------------------------------------------------------------
