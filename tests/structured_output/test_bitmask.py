"""The fast bitmask application against its plain twin and xgrammar's own kernel."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

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


@pytest.mark.parametrize("vocab", [31, 32, 1000, 3001])
@pytest.mark.parametrize("rows", [[0, 2, 5], [0, 1, 2, 3, 4, 5], []])
def test_fast_apply_equals_reference_and_xgrammar(vocab, rows):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    bits = torch.randint(-(1 << 31), 1 << 31, (6, num_words(vocab)), generator=g,
                         dtype=torch.int64).to(torch.int32)
    bits[1, 0] = 0  # a row's first word allowing nothing
    expected = reference_apply_token_bitmask(logits, bits, rows)
    got = logits.clone()
    apply_token_bitmask_(got, bits, rows)
    assert torch.equal(got, expected)
    theirs = logits.clone()
    if rows:
        xgr.apply_token_bitmask_inplace(theirs, bits, indices=rows)
    assert torch.equal(theirs, expected)
    untouched = [r for r in range(6) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])
