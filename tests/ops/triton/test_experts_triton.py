"""Routed experts on the Triton kernels with plain weights (``layers/moe/experts_triton.py``,
what a CUDA engine runs): the sequence (sort by expert, grouped GEMM, SiLU-and-mul, grouped
GEMM, unsort) against the same sequence on the ops' torch twins and against the per-expert
reference loop, in fp32 (full-precision products: equal up to summation order) and bf16."""

from __future__ import annotations

import pytest
import torch

from widellm.layers.moe.experts import reference_experts_forward
from widellm.layers.moe.experts_triton import triton_experts_forward

HIDDEN, INTER = 256, 96  # a partial 128-column tile in both GEMMs
WEIGHT_STD = 0.05
# fp32: both sides sum exact-enough products in another order (K <= 256 terms).
FP32_TOL = 1e-5
# bf16: the kernel rounds the intermediate and the output once each, the reference loop in
# its own places; two bf16 steps of the largest value.
BF16_TOL = 2 * 2**-7
# (name, rows per local expert, skipped rows): spread with an empty expert, a skewed load
# (one expert with most rows: several 64-row tiles), a lone row, only skipped rows.
CASES = [
    ("spread", [9, 0, 4, 12], 3),
    ("skewed", [2, 150, 0, 1], 5),
    ("one_row", [0, 0, 1, 0], 0),
    ("all_skipped", [0, 0, 0, 0], 4),
]


def _inputs(counts, skipped, dtype, device):
    ids = [e for e, n in enumerate(counts) for _ in range(n)] + [-1] * skipped
    perm = torch.randperm(len(ids))  # routed rows arrive in any order
    expert_ids = torch.tensor(ids, dtype=torch.int64)[perm].to(device)
    hidden = torch.randn(len(ids), HIDDEN).to(dtype).to(device)
    w13 = (torch.randn(len(counts), 2 * INTER, HIDDEN) * WEIGHT_STD).to(dtype).to(device)
    w2 = (torch.randn(len(counts), HIDDEN, INTER) * WEIGHT_STD).to(dtype).to(device)
    return hidden, expert_ids, w13, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,counts,skipped", CASES, ids=[c[0] for c in CASES])
def test_triton_experts_equal_their_twins(device, dtype, name, counts, skipped):
    torch.manual_seed(len(name))
    hidden, expert_ids, w13, w2 = _inputs(counts, skipped, dtype, device)
    got = triton_experts_forward(hidden, expert_ids, w13, w2)
    twin = triton_experts_forward(hidden, expert_ids, w13, w2, reference=True)
    loop = reference_experts_forward(hidden.cpu().float(), expert_ids.cpu(), w13.cpu().float(),
                                     w2.cpu().float())
    assert got.shape == twin.shape == (sum(counts) + skipped, HIDDEN)
    assert got.dtype == twin.dtype == dtype
    skipped_rows = expert_ids < 0
    assert bool((got[skipped_rows] == 0).all()) and bool((twin[skipped_rows] == 0).all())
    scale = max(loop.abs().max().item(), 1.0)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert (got.cpu().float() - twin.cpu().float()).abs().max().item() <= tol * scale
    assert (got.cpu().float() - loop).abs().max().item() <= tol * scale


@pytest.mark.parametrize("bad_id", [2, 5])
def test_an_expert_id_past_the_local_experts_is_refused(device, bad_id):
    hidden, expert_ids, w13, w2 = _inputs([2, 1], 0, torch.float32, device)
    expert_ids[0] = bad_id
    with pytest.raises((RuntimeError, IndexError)):
        triton_experts_forward(hidden, expert_ids, w13, w2)
        if device.type == "cuda":
            torch.cuda.synchronize()
