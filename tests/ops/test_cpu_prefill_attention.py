"""The causal prefill kernel (bf16: AMX tiles, and the AVX512-BF16 vector path that CPUs without
AMX take; fp32: AVX2 + FMA) against its torch twin (SDPA with the causal mask) and an fp64
ground truth, on the strided views the layers hand it. Every test runs once per path this CPU
has."""

from __future__ import annotations

import pytest
import torch

from widellm.ops.cpu_attention import prefill_attention_kernels, prefill_attention_reference

pytestmark = pytest.mark.usefixtures("kernels")  # see conftest.py


def _views(L, Lq, H, Hkv, dk, dv, seed, dtype=torch.bfloat16):
    """q, k, v as the Llama layer makes them: column slices of one fused projection row."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(L, H * dk + Hkv * dk + Hkv * dv, generator=gen).to(dtype)
    q = fused[L - Lq:, : H * dk].view(Lq, H, dk)
    k = fused[:, H * dk: (H + Hkv) * dk].view(L, Hkv, dk)
    v = fused[:, (H + Hkv) * dk:].view(L, Hkv, dv)
    return q, k, v


class _Path:
    """The kernels' prefill entry points pinned to one path: AMX, the bf16 vector path
    (``allow_amx=False``, which is what an AVX512-BF16 CPU without AMX runs), or fp32; with the
    dtype and the error bounds of that path."""

    def __init__(self, kernels, allow_amx, dtype):
        self.kernels, self.allow_amx, self.dtype = kernels, allow_amx, dtype
        # bf16: probabilities rounded to bf16 (2^-9 relative) over values of size ~1, then the
        # bf16 output. fp32: sums of a few hundred fp32 products and a polynomial exp.
        self.vs_truth = dict(atol=1.5e-2, rtol=1e-2) if dtype == torch.bfloat16 else \
            dict(atol=1e-5, rtol=1e-5)
        self.vs_twin = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else \
            dict(atol=1e-5, rtol=1e-5)

    def prefill_attention(self, *args):
        self.kernels.prefill_attention(*args, allow_amx=self.allow_amx)

    def prefill_attention_batch(self, *args):
        self.kernels.prefill_attention_batch(*args, allow_amx=self.allow_amx)


@pytest.fixture(params=["amx", "avx512_bf16", "avx2"])
def path(request):
    """Which path the test's kernels calls take; skipped where this CPU lacks it."""
    return request.param


def _kernels(path, dk, dv):
    dtype = torch.float32 if path == "avx2" else torch.bfloat16
    kernels = prefill_attention_kernels(torch.empty(0, dtype=dtype), dk, dv)
    if kernels is None:
        pytest.skip(f"no {path} path on this CPU: the layers take the SDPA path in {dtype}")
    backend = kernels.prefill_attention_backend(dk, dv, dtype)
    if path == "amx" and backend != "amx":
        pytest.skip("this CPU has no AMX")
    return _Path(kernels, allow_amx=path == "amx", dtype=dtype)


# Whole prompts and chunks after a cached prefix (L > Lq); query counts on and off 16; group
# sizes 1, 2, 3 and 6; head sizes 32 to 192 (MLA's expanded 192 / 128), value width != key width.
@pytest.mark.parametrize("L,Lq,H,Hkv,dk,dv", [
    (256, 256, 9, 3, 64, 64), (37, 37, 4, 2, 32, 32), (100, 20, 6, 1, 64, 96),
    (50, 1, 2, 2, 128, 128), (70, 70, 4, 4, 192, 128), (333, 17, 2, 1, 64, 64),
])
def test_kernel_matches_fp64_and_sdpa(path, L, Lq, H, Hkv, dk, dv):
    kernels = _kernels(path, dk, dv)
    q, k, v = _views(L, Lq, H, Hkv, dk, dv, seed=L + dk, dtype=kernels.dtype)
    out = torch.full((Lq, H, dv), float("nan"), dtype=kernels.dtype)
    kernels.prefill_attention(q, k, v, out, dk ** -0.5)
    assert not out.isnan().any()  # every row of every head written
    truth = prefill_attention_reference(q.double(), k.double(), v.double(), dk ** -0.5)
    twin = prefill_attention_reference(q, k, v, dk ** -0.5)
    torch.testing.assert_close(out.double(), truth, **kernels.vs_truth)
    torch.testing.assert_close(out.double(), twin.double(), **kernels.vs_twin)


def test_first_query_of_a_prompt_sees_only_itself(path):
    kernels = _kernels(path, 64, 64)
    q, k, v = _views(20, 20, 3, 3, 64, 64, seed=3, dtype=kernels.dtype)
    out = torch.empty(20, 3, 64, dtype=kernels.dtype)
    kernels.prefill_attention(q, k, v, out, 0.125)
    torch.testing.assert_close(out[0], v[0], atol=0, rtol=0)


def test_writes_into_a_strided_output_slice(path):
    kernels = _kernels(path, 32, 32)
    q, k, v = _views(40, 40, 2, 1, 32, 32, seed=4, dtype=kernels.dtype)
    buf = torch.zeros(60, 2, 32, dtype=kernels.dtype)
    kernels.prefill_attention(q, k, v, buf[10:50], 0.2)
    assert buf[:10].eq(0).all() and buf[50:].eq(0).all()
    expected = prefill_attention_reference(q.double(), k.double(), v.double(), 0.2)
    torch.testing.assert_close(buf[10:50].double(), expected, **kernels.vs_truth)


def test_rejects_bad_shapes(path):
    kernels = _kernels(path, 32, 32)
    q, k, v = _views(10, 10, 4, 2, 32, 32, seed=5, dtype=kernels.dtype)
    out = torch.empty(10, 4, 32, dtype=kernels.dtype)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        kernels.prefill_attention(q, k[:5], v[:5], out, 1.0)
    with pytest.raises(RuntimeError, match="q's dtype"):
        kernels.prefill_attention(q, k.double(), v, out, 1.0)
    with pytest.raises(RuntimeError, match="needs bf16 with AMX or AVX512-BF16"):
        kernels.prefill_attention(q.half(), k.half(), v.half(), out.half(), 1.0)


# Llama-family GQA, and MLA's expanded prefill (one KV head per query head, 192 / 128).
@pytest.mark.parametrize("H,Hkv,dk,dv", [(6, 2, 64, 64), (4, 4, 192, 128)])
def test_batch_of_chunks_equals_one_call_per_chunk(path, H, Hkv, dk, dv):
    """A step's chunks in one call, after two decode rows it must not touch: whole prompts,
    chunks after a cached prefix, a one-token chunk, lengths on and off 16. Each chunk's
    rows equal (bit for bit) the one-chunk call and are close to the fp64 ground truth."""
    kernels = _kernels(path, dk, dv)
    # (context length, query count)
    shapes = [(37, 37), (300, 44), (128, 128), (50, 1), (16, 16), (290, 290)]
    decodes = 2
    total = decodes + sum(lq for _, lq in shapes)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(total, H, dk, generator=gen).to(kernels.dtype)
    ks, vs, query_start_loc = [], [], [decodes]
    for i, (L, Lq) in enumerate(shapes):
        _, k, v = _views(L, Lq, H, Hkv, dk, dv, seed=100 + i, dtype=kernels.dtype)
        ks.append(k)
        vs.append(v)
        query_start_loc.append(query_start_loc[-1] + Lq)
    out = torch.full((total, H, dv), float("nan"), dtype=kernels.dtype)
    kernels.prefill_attention_batch(q, out, ks, vs, query_start_loc, 0.125)
    assert out[:decodes].isnan().all()  # the decode rows are left alone
    for i, (k, v) in enumerate(zip(ks, vs)):
        a, b = query_start_loc[i], query_start_loc[i + 1]
        alone = torch.empty(b - a, H, dv, dtype=kernels.dtype)
        kernels.prefill_attention(q[a:b], k, v, alone, 0.125)
        assert torch.equal(out[a:b], alone), f"chunk {i}"
        truth = prefill_attention_reference(q[a:b].double(), k.double(), v.double(), 0.125)
        torch.testing.assert_close(out[a:b].double(), truth, **kernels.vs_truth)


def test_batch_rejects_mismatched_lists(path):
    kernels = _kernels(path, 32, 32)
    q, k, v = _views(10, 10, 4, 2, 32, 32, seed=5, dtype=kernels.dtype)
    out = torch.empty(10, 4, 32, dtype=kernels.dtype)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        kernels.prefill_attention_batch(q, out, [k], [v], [0], 1.0)
    with pytest.raises(RuntimeError, match="shapes do not match"):  # rows past q's end
        kernels.prefill_attention_batch(q, out, [k], [v], [0, 11], 1.0)


@pytest.mark.parametrize("dk,dv", [(8, 8), (24, 40), (72, 56)])
def test_fp32_head_sizes_in_multiples_of_8(dk, dv):
    """The fp32 path takes head sizes the bf16 paths do not (multiples of 8, not 32): a lone
    8-column value vector, and key panels over any number of components."""
    kernels = _kernels("avx2", dk, dv)
    q, k, v = _views(59, 41, 4, 2, dk, dv, seed=dk + dv, dtype=torch.float32)
    out = torch.full((41, 4, dv), float("nan"))
    kernels.prefill_attention(q, k, v, out, dk ** -0.5)
    truth = prefill_attention_reference(q.double(), k.double(), v.double(), dk ** -0.5)
    torch.testing.assert_close(out.double(), truth, **kernels.vs_truth)
    assert kernels.kernels.prefill_attention_backend(dk, dv, torch.bfloat16) == "none"
