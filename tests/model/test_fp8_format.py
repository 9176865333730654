"""DeepSeek-V3's block FP8 format (widellm/model/fp8.py) and the loader's weight/scale pairing
(widellm/model/fp8_weights.py): exact expectations, since the format is exact arithmetic on
e4m3 values times fp32 scales."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from widellm.model.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    WEIGHT_BLOCK_SIZE,
    deepseek_fp8_quantization_config,
    dequantize_weight_block_fp8,
    dequantize_weight_block_fp8_reference,
    quantize_weight_block_fp8,
    quantize_weight_block_fp8_reference,
    scale_grid,
)
from widellm.model.fp8_weights import Fp8BlockQuantConfig, fp8_block_weights, with_scales

BLOCK = WEIGHT_BLOCK_SIZE[0]
# 2 full blocks + a partial one in both directions (44 rows, 4 columns).
PARTIAL_SHAPE = (2 * BLOCK + 44, 2 * BLOCK + 4)
# Exact multiples, smaller than a block, a single element, and DeepSeek-V3's partial
# kv_a_proj_with_mqa row count scaled down (576 = 4.5 blocks).
SHAPES = [PARTIAL_SHAPE, (2 * BLOCK, BLOCK), (48, 64), (1, 1), (BLOCK * 9 // 2, BLOCK)]
# e4m3fn bit patterns that are NaN (the format has no infinities).
NAN_BYTES = (0x7F, 0xFF)
# Largest relative rounding error of e4m3 normals: 3 mantissa bits -> half an ulp = 2^-4.
E4M3_REL_ERR = 2.0**-4
# Half the e4m3 subnormal spacing (2^-9), in units of the block scale.
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10
DEEPSEEK_CONFIG = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of an fp8 tensor, so -0 and +0 (and every code) compare exactly."""
    return t.view(torch.uint8)


def representable_weight(shape, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w fp32, q fp8, scale_inv fp32) where w = q * scale_inv exactly, every block's scale a
    power of two and its largest |q| exactly 448, so quantizing w must give back q and
    scale_inv bit for bit."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    for nan in NAN_BYTES:
        codes[codes == nan] = 0
    q = codes.view(FP8_DTYPE).clone()
    # Random codes stay within +-224 (exact in e4m3); then one +-448 per block, inside the real
    # (unpadded) part of edge blocks, is that block's amax.
    q = q.float().clamp(-FP8_MAX / 2, FP8_MAX / 2).to(FP8_DTYPE)
    grid = scale_grid(shape, WEIGHT_BLOCK_SIZE)
    for i in range(grid[0]):
        for j in range(grid[1]):
            sign = 1.0 if (i + j) % 2 == 0 else -1.0
            q[i * BLOCK, j * BLOCK] = sign * FP8_MAX
    exponents = torch.randint(-12, 3, grid, generator=g)
    scale_inv = torch.pow(2.0, exponents.float())
    w = q.float()
    for i in range(grid[0]):
        for j in range(grid[1]):
            w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] *= scale_inv[i, j]
    return w, q, scale_inv


def test_docstring_example_by_hand():
    w = torch.tensor([[0.5, -1.75, 3.5]])
    q, scale_inv = quantize_weight_block_fp8(w)
    assert q.dtype == FP8_DTYPE and scale_inv.dtype == torch.float32
    assert q.float().tolist() == [[64.0, -224.0, 448.0]]
    assert scale_inv.tolist() == [[2.0**-7]]
    assert dequantize_weight_block_fp8(q, scale_inv).tolist() == w.tolist()


@pytest.mark.parametrize("shape", [PARTIAL_SHAPE, (2 * BLOCK, 3 * BLOCK), (BLOCK * 9 // 2, 40)])
def test_representable_values_round_trip_exactly(shape):
    w, q0, s0 = representable_weight(shape, seed=sum(shape))
    q, scale_inv = quantize_weight_block_fp8(w)
    assert torch.equal(scale_inv, s0)
    assert torch.equal(bits(q), bits(q0))
    assert torch.equal(dequantize_weight_block_fp8(q, scale_inv), w)


@pytest.mark.parametrize("shape", SHAPES)
def test_shapes_dtypes_and_twins_agree_bit_for_bit(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 0.02
    q, scale_inv = quantize_weight_block_fp8(w)
    q_ref, scale_ref = quantize_weight_block_fp8_reference(w)
    expected_grid = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
    assert q.shape == w.shape and q.dtype == FP8_DTYPE
    assert tuple(scale_inv.shape) == expected_grid and scale_inv.dtype == torch.float32
    assert torch.equal(scale_inv, scale_ref)
    assert torch.equal(bits(q), bits(q_ref))
    deq = dequantize_weight_block_fp8(q, scale_inv)
    assert torch.equal(deq, dequantize_weight_block_fp8_reference(q, scale_inv))
    # Rounding to e4m3 is the only error: relative 2^-4 for normals, an absolute half
    # subnormal step (times the block scale) near zero.
    full_scale = scale_inv.repeat_interleave(BLOCK, 0)[: shape[0]].repeat_interleave(BLOCK, 1)
    bound = E4M3_REL_ERR * w.abs() + E4M3_SUBNORMAL_HALF_STEP * full_scale[:, : shape[1]]
    assert ((deq - w).abs() <= bound).all()
    # Each block's largest |w| lands exactly on +-448.
    for i in range(expected_grid[0]):
        for j in range(expected_grid[1]):
            block = q.float()[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            assert block.abs().max() == FP8_MAX


@pytest.mark.parametrize(
    "row, col", [(0, 0), (127, 127), (128, 0), (0, 128), (255, 129), (299, 259)]
)
def test_scale_layout_one_entry_per_block(row, col):
    """A single nonzero element lands in scale entry (row // 128, col // 128), edges too."""
    w = torch.zeros(PARTIAL_SHAPE)
    w[row, col] = 4 * FP8_MAX  # amax / 448 = 4, unlike the 1.0 of all-zero blocks
    q, scale_inv = quantize_weight_block_fp8(w)
    expected = torch.ones(3, 3)
    expected[row // BLOCK, col // BLOCK] = 4.0
    assert torch.equal(scale_inv, expected)
    assert q.float().nonzero().tolist() == [[row, col]]
    assert q.float()[row, col] == FP8_MAX


def test_zero_blocks_and_dtypes():
    q, scale_inv = quantize_weight_block_fp8(torch.zeros(130, 5, dtype=torch.bfloat16))
    assert scale_inv.tolist() == [[1.0], [1.0]]
    assert not q.float().any()
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(3))
    q, scale_inv = quantize_weight_block_fp8(w)
    bf16 = dequantize_weight_block_fp8(q, scale_inv, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    # The product is formed in fp32 and rounded once.
    assert torch.equal(bf16, dequantize_weight_block_fp8(q, scale_inv).to(torch.bfloat16))


def test_wrong_scale_grid_is_rejected():
    q, scale_inv = quantize_weight_block_fp8(torch.ones(PARTIAL_SHAPE))
    with pytest.raises(ValueError, match=r"expected \(3, 3\)"):
        dequantize_weight_block_fp8(q, scale_inv[:2])
    with pytest.raises(ValueError, match=r"expected \(3, 3\)"):
        dequantize_weight_block_fp8(q, scale_inv.T[:, :2])


def test_quantization_config_parsing():
    assert deepseek_fp8_quantization_config() == DEEPSEEK_CONFIG
    cfg = Fp8BlockQuantConfig.from_hf_config(SimpleNamespace(quantization_config=DEEPSEEK_CONFIG))
    assert cfg == Fp8BlockQuantConfig(weight_block_size=(128, 128), activation_scheme="dynamic")
    assert Fp8BlockQuantConfig.from_hf_config(SimpleNamespace()) is None
    bad = {
        "quant_method": ({**DEEPSEEK_CONFIG, "quant_method": "gptq"}, "gptq"),
        "fmt": ({**DEEPSEEK_CONFIG, "fmt": "e5m2"}, "e5m2"),
        "static": ({**DEEPSEEK_CONFIG, "activation_scheme": "static"}, "static"),
        "per-tensor": ({k: v for k, v in DEEPSEEK_CONFIG.items() if k != "weight_block_size"},
                       "per-tensor"),
    }
    for raw, message in bad.values():
        with pytest.raises(ValueError, match=message):
            Fp8BlockQuantConfig.from_hf_config(SimpleNamespace(quantization_config=raw))


def _checkpoint_stream(order: str) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """A small FP8 checkpoint stream (two quantized linears, one norm) in a given order."""
    g = torch.Generator().manual_seed(11)
    dense = {"a.weight": torch.randn(300, 70, generator=g),
             "b.weight": torch.randn(5, 129, generator=g)}
    stream = [("norm.weight", torch.ones(70))]
    for name, w in dense.items():
        q, s = quantize_weight_block_fp8(w)
        pair = [(name, q), (name + "_scale_inv", s)]
        stream += pair if order == "weight_first" else pair[::-1]
    return stream, dense


@pytest.mark.parametrize("order", ["weight_first", "scale_first"])
def test_stream_dequantizes_each_pair_and_passes_the_rest(order):
    stream, dense = _checkpoint_stream(order)
    quant = Fp8BlockQuantConfig(weight_block_size=WEIGHT_BLOCK_SIZE)
    out = dict(fp8_block_weights(stream, quant, torch.float32, keep_fp8=False))
    assert sorted(out) == ["a.weight", "b.weight", "norm.weight"]
    raw = dict(stream)
    for name in dense:
        assert out[name].dtype == torch.float32
        assert torch.equal(out[name], dequantize_weight_block_fp8_reference(
            raw[name], raw[name + "_scale_inv"]))
    assert out["norm.weight"] is raw["norm.weight"]


def test_stream_keeping_fp8_passes_weight_and_scale_through():
    """The other side of the linear-method seam: FP8 weight and its scale, unchanged."""
    stream, _ = _checkpoint_stream("scale_first")
    quant = Fp8BlockQuantConfig(weight_block_size=WEIGHT_BLOCK_SIZE)
    out = list(fp8_block_weights(stream, quant, torch.bfloat16, keep_fp8=True))
    raw = dict(stream)
    assert [n for n, _ in out] == [
        "norm.weight", "a.weight", "a.weight_scale_inv", "b.weight", "b.weight_scale_inv"]
    for name, tensor in out:
        assert tensor is raw[name]


def test_stream_rejects_unpaired_and_misshapen_tensors():
    quant = Fp8BlockQuantConfig(weight_block_size=WEIGHT_BLOCK_SIZE)
    stream, _ = _checkpoint_stream("weight_first")
    no_scale = [item for item in stream if item[0] != "b.weight_scale_inv"]
    with pytest.raises(ValueError, match=r"no matching \*\.weight_scale_inv.*b\.weight"):
        list(fp8_block_weights(no_scale, quant, torch.float32))
    no_weight = [item for item in stream if item[0] != "a.weight"]
    with pytest.raises(ValueError, match="a.weight_scale_inv"):
        list(fp8_block_weights(no_weight, quant, torch.float32))
    misshapen = [(n, t[:1] if n == "a.weight_scale_inv" else t) for n, t in stream]
    with pytest.raises(ValueError, match=r"^a\.weight: weight_scale_inv shape"):
        list(fp8_block_weights(misshapen, quant, torch.float32))


def test_expert_parallel_skip_covers_the_scale():
    remote = {"model.layers.1.mlp.experts.3.up_proj.weight"}
    skip = with_scales(remote.__contains__)
    assert skip("model.layers.1.mlp.experts.3.up_proj.weight")
    assert skip("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv")
    assert not skip("model.layers.1.mlp.experts.2.up_proj.weight_scale_inv")
    assert not skip("model.layers.1.mlp.experts.2.up_proj.weight")
    assert with_scales(None) is None
