"""EPLB load recorder: exact counts, window sliding, padding ignored, reset."""

from __future__ import annotations

import pytest
import torch

from widellm.eplb.stats import ExpertLoadRecorder


def test_exact_counts_over_steps():
    rec = ExpertLoadRecorder(num_layers=2, num_physical=4, window_size=3)
    rec.record(0, torch.tensor([[0, 1], [1, 3]]))
    rec.record(1, torch.tensor([[2, 2], [2, 0]]))
    rec.record(0, torch.tensor([[3, 3]]))  # a second forward of layer 0 in the same step adds
    assert rec.window_load().tolist() == [[1, 2, 0, 3], [1, 0, 3, 0]]
    rec.step()
    rec.record(1, torch.tensor([[1, 2]], dtype=torch.int32))  # int32 ids (router dtype)
    assert rec.window_load().tolist() == [[1, 2, 0, 3], [1, 1, 4, 0]]
    assert rec.window_load().dtype == torch.int64


def test_window_slides():
    rec = ExpertLoadRecorder(num_layers=1, num_physical=3, window_size=2)
    rec.record(0, torch.tensor([[0, 0]]))  # step A
    rec.step()
    rec.record(0, torch.tensor([[1, 1]]))  # step B
    assert rec.window_load().tolist() == [[2, 2, 0]]
    rec.step()  # A leaves the window
    assert rec.window_load().tolist() == [[0, 2, 0]]
    rec.record(0, torch.tensor([[2, 2]]))  # step C
    assert rec.window_load().tolist() == [[0, 2, 2]]
    rec.step()  # B leaves
    rec.step()  # C leaves: nothing recorded since
    assert rec.window_load().tolist() == [[0, 0, 0]]
    # Many wraps of the ring: only the last window_size steps count.
    for i in range(7):
        rec.record(0, torch.full((1, 1), i % 3))
        if i < 6:
            rec.step()
    # Steps i = 5 (slot 2) and i = 6 (slot 0) remain.
    assert rec.window_load().tolist() == [[1, 0, 1]]


def test_padding_ignored():
    rec = ExpertLoadRecorder(num_layers=2, num_physical=4, window_size=1)
    rec.record(1, torch.tensor([[-1, -1], [3, -1], [-1, 0]]))
    rec.record(0, torch.full((5, 8), -1))
    assert rec.window_load().tolist() == [[0, 0, 0, 0], [1, 0, 0, 1]]
    rec.record(0, torch.empty(0, 8, dtype=torch.int64))  # an empty batch is fine too
    assert rec.window_load().sum().item() == 2


def test_reset():
    rec = ExpertLoadRecorder(num_layers=1, num_physical=2, window_size=2)
    rec.record(0, torch.tensor([[0, 1]]))
    rec.step()
    rec.record(0, torch.tensor([[1, 1]]))
    rec.reset()
    assert rec.window_load().tolist() == [[0, 0]]
    rec.record(0, torch.tensor([[0]]))
    rec.step()
    rec.record(0, torch.tensor([[1]]))
    assert rec.window_load().tolist() == [[1, 1]]
    rec.step()  # after reset the ring restarted at row 0: the first record leaves now
    assert rec.window_load().tolist() == [[0, 1]]


def test_matches_bincount_on_random_steps():
    gen = torch.Generator().manual_seed(0)
    num_layers, num_physical, window = 3, 9, 4
    rec = ExpertLoadRecorder(num_layers, num_physical, window)
    history = []
    for _ in range(11):
        step = torch.zeros(num_layers, num_physical, dtype=torch.int64)
        for layer in range(num_layers):
            ids = torch.randint(-1, num_physical, (6, 2), generator=gen)
            rec.record(layer, ids)
            valid = ids[ids >= 0]
            step[layer] += torch.bincount(valid, minlength=num_physical)
        history.append(step)
        assert torch.equal(rec.window_load(), torch.stack(history[-window:]).sum(0))
        rec.step()


def test_bad_sizes():
    with pytest.raises(ValueError):
        ExpertLoadRecorder(1, 4, 0)
    with pytest.raises(ValueError):
        ExpertLoadRecorder(0, 4, 2)
