"""The fast bitmask application (xgrammar's kernel) against its plain torch twin."""

from __future__ import annotations

import torch

from widellm.structured_output.bitmask import (
    allocate_token_bitmask, apply_token_bitmask_, num_words, reference_apply_token_bitmask,
    unpack_bitmask,
)


def test_unpack_reads_bit_j_of_word_w_as_token_32w_plus_j():
    bitmask = torch.zeros(1, num_words(70), dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[0, 2] = 1 << 5  # token 69
    assert unpack_bitmask(bitmask, 70)[0].nonzero().flatten().tolist() == [0, 2, 69]
    # -1 (all bits set, the sign bit included) allows all 32 tokens of its word.
    assert unpack_bitmask(allocate_token_bitmask(1, 70), 70).all()


def test_fast_apply_equals_reference_on_random_masks():
    g = torch.Generator().manual_seed(0)
    for vocab in (31, 32, 1000, 49152):
        logits = torch.randn(6, vocab, generator=g)
        bits = torch.randint(-(1 << 31), 1 << 31, (6, num_words(vocab)), generator=g,
                             dtype=torch.int64).to(torch.int32)
        rows = [0, 2, 5]
        expected = reference_apply_token_bitmask(logits, bits, rows)
        got = logits.clone()
        apply_token_bitmask_(got, bits, rows)
        assert torch.equal(got, expected), vocab
        # Rows not named keep every logit.
        assert torch.equal(got[[1, 3, 4]], logits[[1, 3, 4]])
