"""The sampler's per-request behaviour: seeded rows independent of the batch, the forward
equal to the reference sampler row by row, logit bias, min_tokens, sampling frequencies,
logprobs, bf16 logits and the chunked argmax. (Metadata, penalties and filters:
``test_sampler.py``.)"""

import math

import pytest
import torch

from tests.worker.sampler_cases import build, random_ids, sample, seeded
from widellm.sampling_params import SamplingParams
from widellm.worker.sampler import (
    ARGMAX_CHUNK,
    row_argmax,
    compute_logprobs,
    fill_exponential_,
    gather_logprobs,
)
from widellm.worker.sampler_reference import reference_sample_row


def _request_logits(seed: int, vocab_size: int) -> torch.Tensor:
    # Flat enough that tokens vary from step to step.
    return torch.randn(vocab_size, generator=seeded(seed)) * 0.5


def test_seeded_rows_ignore_batch_composition_and_order():
    vocab_size, num_steps = 32, 6
    la, lb, lu, lg = (_request_logits(s, vocab_size) for s in (100, 101, 102, 103))
    pa = SamplingParams(temperature=0.9, seed=11)
    pb = SamplingParams(temperature=1.3, top_k=10, seed=22)
    pu = SamplingParams(temperature=1.0)
    pg = SamplingParams(temperature=0.0)

    def run(rows):
        """rows: list of (name, logits, params); returns name -> tokens over the steps."""
        gens = {i: seeded(p.seed) for i, (_, _, p) in enumerate(rows) if p.seed is not None}
        logits = torch.stack([lg for _, lg, _ in rows])
        tokens = {name: [] for name, _, _ in rows}
        for _ in range(num_steps):
            md = build([p for _, _, p in rows], vocab_size, generators=gens)
            sampled = sample(logits, md).sampled_token_ids.tolist()
            for (name, _, _), t in zip(rows, sampled):
                tokens[name].append(t)
        return tokens

    first = run([("a", la, pa), ("u", lu, pu), ("b", lb, pb), ("g", lg, pg)])
    second = run([("u", lu, pu), ("b", lb, pb), ("u2", lu, pu), ("g", lg, pg), ("a", la, pa)])
    alone = run([("a", la, pa)])
    assert first["a"] == second["a"] == alone["a"]
    assert first["b"] == second["b"]
    assert len(set(first["a"])) > 1 and len(set(first["b"])) > 1


def test_different_seeds_give_different_sequences():
    vocab_size, num_steps = 16, 40

    def run(seed):
        gens = {0: seeded(seed)}
        md = build([SamplingParams(seed=seed)], vocab_size, generators=gens)
        return [
            sample(torch.zeros(1, vocab_size), md).sampled_token_ids.item()
            for _ in range(num_steps)
        ]

    one, two, one_again = run(1), run(2), run(1)
    assert one == one_again
    assert one != two
    assert len(set(one)) > vocab_size // 2 and len(set(two)) > vocab_size // 2


def test_forward_matches_reference_sample_row():
    gen = seeded(3)
    vocab_size = 48
    params = [
        SamplingParams(temperature=0.8, top_k=6, seed=1, repetition_penalty=1.4),
        SamplingParams(temperature=1.2, top_p=0.9, seed=2, frequency_penalty=0.6),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=1.0, min_p=0.2, seed=3, min_tokens=4, stop_token_ids=[5]),
        SamplingParams(temperature=0.5, top_k=12, top_p=0.6, min_p=0.1, seed=4),
        SamplingParams(temperature=0.9, seed=5, logit_bias={7: 2.5, 9: -100.0}),
        SamplingParams(temperature=0.0, logit_bias={11: 100.0}, repetition_penalty=1.2),
        SamplingParams(temperature=1.1, seed=6, allowed_token_ids=[3, 8, 20, 41],
                       logit_bias={8: 1.5, 9: 100.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[2, 30], frequency_penalty=0.4),
    ]
    prompts = [random_ids(gen, vocab_size, 6) for _ in params]
    outputs = [random_ids(gen, vocab_size, 3) for _ in params]
    gens = {row: seeded(p.seed) for row, p in enumerate(params) if p.seed is not None}
    for _ in range(4):
        logits = torch.randn(len(params), vocab_size, generator=gen)
        logits[3, 5] = 10.0  # the stop token would win if it were not masked
        noise = {}
        for row, g in gens.items():
            twin = torch.Generator().manual_seed(0)
            twin.set_state(g.get_state())
            noise[row] = fill_exponential_(torch.empty(vocab_size), twin)
        md = build(params, vocab_size, outputs=outputs, prompts=prompts, generators=gens)
        got = sample(logits, md).sampled_token_ids.tolist()
        expected = [
            reference_sample_row(
                logits[row], p, prompts[row], outputs[row],
                md.stop_token_ids_to_mask.get(row, ()), noise.get(row),
            )
            for row, p in enumerate(params)
        ]
        assert got == expected
        assert got[3] != 5
        assert got[6] == 11 and got[5] != 9
        assert got[7] in (3, 8, 20, 41) and got[8] in (2, 30)  # a bias cannot unban token 9


def test_logit_bias_bans_and_forces_tokens_in_greedy_batches():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 3)
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={1: -100.0}),
              SamplingParams(temperature=0.0, logit_bias={0: 100.0})]
    md = build(params, vocab_size=4)
    assert sample(logits.clone(), md).sampled_token_ids.tolist() == [1, 3, 0]


def test_allowed_token_ids_ban_every_other_token_in_greedy_batches():
    """The greedy fast path is left when a row has allowed ids: its argmax is over them only;
    the row without any keeps the full vocabulary."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 3)
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, allowed_token_ids=[0, 2]),
              SamplingParams(temperature=0.0, allowed_token_ids=[3])]
    md = build(params, vocab_size=4)
    assert sample(logits.clone(), md).sampled_token_ids.tolist() == [1, 2, 3]
    assert md.allowed_token_mask[0].tolist() == [1, 2]
    assert md.allowed_token_mask[1].tolist() == [[False, True, False, True],
                                                 [True, True, True, False]]


def test_min_tokens_never_masks_a_rows_last_allowed_tokens():
    """A grammar that admits only EOS (the rest already -inf) wins over min_tokens; a row with
    other tokens left still has its stop ids masked."""
    eos = 2
    logits = torch.full((2, 5), float("-inf"))
    logits[0, eos] = 0.0
    logits[1, eos], logits[1, 4] = 3.0, 1.0
    params = [SamplingParams(temperature=0.0, min_tokens=3)] * 2
    md = build(params, vocab_size=5, eos=[[eos], [eos]])
    assert md.stop_token_ids_to_mask == {0: [eos], 1: [eos]}
    assert sample(logits.clone(), md).sampled_token_ids.tolist() == [eos, 4]
    for row in range(2):
        assert reference_sample_row(logits[row], params[row], [], [], [eos]) == [eos, 4][row]


def test_temperature_sampling_frequencies_follow_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5])
    temperature, num_rows = 0.7, 4000
    md = build([SamplingParams(temperature=temperature)] * num_rows, vocab_size=4)
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        tokens = sample(logits.repeat(num_rows, 1), md).sampled_token_ids
    freqs = torch.bincount(tokens, minlength=4).float() / num_rows
    expected = torch.softmax(logits / temperature, dim=-1)
    # Standard error is at most 0.008 here; 0.03 is nearly four of them.
    torch.testing.assert_close(freqs, expected, rtol=0.0, atol=0.03)


# ---- logprobs --------------------------------------------------------------------------


def test_logprobs_columns_and_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 0.0, 2.0]])
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        # Masking token 1 makes greedy take token 2; logprobs still come from the raw logits.
        SamplingParams(temperature=0.0, logprobs=1, min_tokens=1, stop_token_ids=[1]),
        SamplingParams(temperature=0.0),
    ]
    out = sample(logits, build(params, vocab_size=4))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.sampled_token_ids.tolist() == [1, 2, 3]
    lp = out.logprobs
    assert lp.logprob_token_ids.dtype == torch.int64
    assert lp.logprob_token_ids.tolist() == [[1, 1, 2], [2, 1, 2], [3, 3, 0]]
    expected = torch.stack([raw[r, lp.logprob_token_ids[r]] for r in range(3)])
    assert torch.equal(lp.logprobs, expected)
    assert lp.selected_token_ranks.tolist() == [1, 2, 1]
    # Sanity of the exact values against math.
    total = math.log(sum(math.exp(v) for v in (1.0, 3.0, 2.0, 0.0)))
    assert lp.logprobs[0, 0].item() == pytest.approx(3.0 - total, abs=1e-6)


def test_gather_logprobs_zero_top_and_ties():
    logprobs = compute_logprobs(torch.tensor([[0.0, 2.0, 2.0, 1.0], [0.0, 1.0, 2.0, 3.0]]))
    assert logprobs.dtype == torch.float32
    got = gather_logprobs(logprobs, torch.tensor([2, 0]), num_logprobs=0)
    assert got.logprob_token_ids.tolist() == [[2], [0]]
    assert torch.equal(got.logprobs, logprobs.gather(1, torch.tensor([[2], [0]])))
    # Token 2 ties with token 1 for the top: both rank 1.
    assert got.selected_token_ranks.tolist() == [1, 4]


def test_bf16_logits_sample_like_fp32():
    logits = torch.randn(4, 32, generator=seeded(6)).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, seed=9, top_k=4),
        SamplingParams(temperature=0.0),
    ]
    outputs = [[1, 2], [3], [], [4]]

    def run(x):
        md = build(params, 32, outputs=outputs, prompts=[[5]] * 4, generators={2: seeded(9)})
        return sample(x, md)

    low, high = run(logits), run(logits.float())
    assert torch.equal(low.sampled_token_ids, high.sampled_token_ids)
    assert low.logprobs.logprobs.dtype == torch.float32
    assert torch.equal(low.logprobs.logprobs, high.logprobs.logprobs)


def test_compute_logprobs_upcasts():
    logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.bfloat16)
    assert torch.equal(compute_logprobs(logits), torch.log_softmax(logits.float(), dim=-1))


# ---- min_tokens ------------------------------------------------------------------------


def test_min_tokens_prevents_stop_and_eos():
    stop, eos = 3, 0
    logits = torch.tensor([[9.0, 1.0, 2.0, 8.0]])
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop])]
    masked = build(params, vocab_size=4, outputs=[[1]], eos=[{eos}])
    assert sample(logits, masked).sampled_token_ids.tolist() == [2]
    done = build(params, vocab_size=4, outputs=[[1, 1]], eos=[{eos}])
    assert sample(logits, done).sampled_token_ids.tolist() == [0]


def test_min_tokens_masks_random_rows():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]]).repeat(200, 1)
    params = [SamplingParams(min_tokens=1, stop_token_ids=[1, 3])] * 200
    md = build(params, vocab_size=4)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        tokens = sample(logits, md).sampled_token_ids
    assert set(tokens.tolist()) == {0, 2}


@pytest.mark.parametrize("vocab", [7, ARGMAX_CHUNK * 3, ARGMAX_CHUNK * 3 + 5, 50257])
def test_row_argmax_matches_torch_argmax_including_ties(vocab):
    gen = torch.Generator().manual_seed(vocab)
    # Few distinct values: many ties within and across chunks, and in the tail.
    x = torch.randint(0, 4, (9, vocab), generator=gen).float()
    x[0] = 0.0  # all tied: index 0
    x[1, -1] = 10.0  # max only in the tail (or last chunk)
    x[2, ARGMAX_CHUNK - 1 if vocab > ARGMAX_CHUNK else 0] = 10.0
    x[2, -1] = 10.0  # tie between an early chunk and the tail: the early one wins
    expected = x.argmax(dim=-1)
    assert row_argmax(x).tolist() == expected.tolist()
    assert row_argmax(x.bfloat16()).tolist() == x.bfloat16().argmax(dim=-1).tolist()
    assert row_argmax(x)[0] == 0
