"""The oneDNN-packed linear fast path (bf16 where oneDNN runs bf16 here, fp32 everywhere)
against its reference, plain ``nn.Linear``: same outputs, exactly which modules get packed
(never a tied or otherwise shared weight, but the LM head, which gets its own copy), the plain
weights really freed, and whole models generating the same tokens either way."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import TINY_MODELS
from widellm import LLM, SamplingParams
from widellm.layers.linear import (
    PACKED_LINEAR_ENV, Linear, pack_linear, pack_linear_weights, packed_linear_available,
    packed_linear_enabled, warm_packed_linears,
)
from widellm.layers.linear_onednn import OneDNNPackedLinearMethod
from widellm.model.loader import build_model, load_hf_config

needs_onednn_bf16 = pytest.mark.skipif(
    not packed_linear_available(), reason="oneDNN bf16 linear not available on this CPU/torch"
)
needs_onednn = pytest.mark.skipif(
    not packed_linear_available(torch.float32), reason="no oneDNN in this torch"
)
# Every packable dtype, bf16 only where oneDNN has bf16 kernels on this CPU.
DTYPES = [pytest.param(torch.bfloat16, marks=needs_onednn_bf16, id="bf16"),
          pytest.param(torch.float32, marks=needs_onednn, id="fp32")]
# The dtype the dtype-independent tests pack: bf16 (the CPU default) where it can be packed.
PACK_DTYPE = torch.bfloat16 if packed_linear_available() else torch.float32

IN_FEATURES, OUT_FEATURES = 200, 300  # not multiples of oneDNN's blocks
# Relative to the output's scale: the output rounding (bf16: 2^-8; fp32: 2^-24 times the
# ~sqrt(200)-term sums' growth) with room for a different accumulation order than F.linear.
REL_TOL = {torch.bfloat16: 2.0**-7, torch.float32: 2.0**-18}
PROMPTS = [list(range(20, 45)), [7, 3, 99, 250, 11], list(range(300, 340, 3))]
MAX_TOKENS = 6
LOGPROB_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _is_packed(m: nn.Module) -> bool:
    return isinstance(m, Linear) and isinstance(m.linear_method, OneDNNPackedLinearMethod)


def _linear(bias: bool, seed: int = 0, dtype: torch.dtype = PACK_DTYPE) -> nn.Linear:
    torch.manual_seed(seed)
    return Linear(IN_FEATURES, OUT_FEATURES, bias=bias).to(dtype)


def _packed_copy(lin: nn.Linear) -> nn.Linear:
    out = Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                    dtype=lin.weight.dtype)
    out.load_state_dict(lin.state_dict())
    pack_linear(out)
    return out


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= REL_TOL[want.dtype] * scale, f"max abs diff {err} vs output scale {scale}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_packed_matches_f_linear(m, bias, dtype):
    lin = _linear(bias, dtype=dtype)
    packed = _packed_copy(lin)
    assert _is_packed(packed) and packed.packed_weight.dtype == dtype
    x = torch.randn(m, IN_FEATURES, dtype=dtype)
    with torch.inference_mode():
        _assert_close(packed(x), F.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_takes_any_leading_shape_strides_and_empty_batches(dtype):
    lin = _linear(bias=True, dtype=dtype)
    packed = _packed_copy(lin)
    with torch.inference_mode():
        x3 = torch.randn(3, 5, IN_FEATURES, dtype=dtype)
        _assert_close(packed(x3), lin(x3))
        wide = torch.randn(9, IN_FEATURES + 56, dtype=dtype)
        x_slice = wide[:, 13:13 + IN_FEATURES]  # row stride != in_features
        x_t = torch.randn(IN_FEATURES, 9, dtype=dtype).t()  # column-major
        for x in (x_slice, x_t):
            assert not x.is_contiguous()
            _assert_close(packed(x), lin(x))
        assert packed(torch.empty(0, IN_FEATURES, dtype=dtype)).shape == (0, OUT_FEATURES)


@needs_onednn
def test_pack_frees_the_plain_weight_and_keeps_no_checkpoint_entry():
    lin = _linear(bias=True)
    weight = weakref.ref(lin.weight)
    pack_linear(lin)
    gc.collect()
    assert weight() is None  # the plain copy is gone: memory is not doubled
    assert "weight" not in dict(lin.named_parameters())
    assert set(lin.state_dict()) == {"bias"}
    with pytest.raises(AttributeError):
        lin.weight  # noqa: B018 - reading it after packing must fail loudly


class _TwoHeads(nn.Module):
    """An embedding tied to one head, a head whose weight another tensor aliases, a plain bf16
    head, a plain fp32 head, an fp16 head and a torch nn.Linear subclass: only the plain bf16
    and fp32 heads may be packed."""

    class _Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    def __init__(self) -> None:
        super().__init__()
        bf16 = torch.bfloat16
        self.embed = nn.Embedding(OUT_FEATURES, IN_FEATURES, dtype=bf16)
        self.tied = Linear(IN_FEATURES, OUT_FEATURES, bias=False, dtype=bf16)
        self.tied.weight = self.embed.weight
        self.aliased = Linear(IN_FEATURES, OUT_FEATURES, bias=False, dtype=bf16)
        self.split = self.aliased.weight.detach()[:10]  # like a load-time split (MLA's w_uk)
        self.plain = Linear(IN_FEATURES, OUT_FEATURES, dtype=bf16)
        self.fp32 = Linear(IN_FEATURES, OUT_FEATURES)
        self.fp16 = Linear(IN_FEATURES, OUT_FEATURES, dtype=torch.float16)
        self.scaled = self._Scaled(IN_FEATURES, OUT_FEATURES, dtype=bf16)


@needs_onednn
def test_only_unshared_plain_linears_are_packed():
    model = _TwoHeads()
    embed_weight = model.embed.weight
    # bf16 only where oneDNN runs it (on AVX2 CPUs the plain bf16 head stays plain).
    expected = {"plain", "fp32"} if packed_linear_available() else {"fp32"}
    assert pack_linear_weights(model, enabled=True) == len(expected)
    for name in ("tied", "aliased", "plain", "fp32", "fp16", "scaled"):
        assert _is_packed(getattr(model, name)) == (name in expected), name
    assert model.tied.weight is model.embed.weight is embed_weight
    # Already packed modules are not packed twice.
    assert pack_linear_weights(model, enabled=True) == 0


def test_disabled_packs_nothing(monkeypatch):
    model = _TwoHeads()
    assert pack_linear_weights(model, enabled=False) == 0
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    assert not packed_linear_enabled()
    assert pack_linear_weights(model) == 0
    assert not any(_is_packed(m) for m in model.modules())
    monkeypatch.setenv(PACKED_LINEAR_ENV, "maybe")
    with pytest.raises(ValueError, match=PACKED_LINEAR_ENV):
        packed_linear_enabled()


# Plain nn.Linear modules per tiny model, lm_head included (a tied one gets its own copy):
# llama-tiny: 2 layers x (qkv, o, gate_up, down) + lm_head tied to the embedding.
# deepseek-v3-tiny: 3 layers x MLA (q_a, q_b, kv_a, kv_b, o) + layer 0's dense MLP (gate_up,
# down) + 2 MoE layers' shared experts (gate_up, down) + lm_head; its router is fp32 and no
# nn.Linear, its routed experts are stacked FusedMoE weights.
EXPECTED_PACKED = {"LlamaForCausalLM": 2 * 4 + 1, "DeepseekV3ForCausalLM": 3 * 5 + 2 + 2 * 2 + 1}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", sorted(EXPECTED_PACKED))
def test_build_model_packs_linears(arch, dtype, model_dir, monkeypatch):
    monkeypatch.delenv(PACKED_LINEAR_ENV, raising=False)
    path = model_dir(arch)
    cfg = load_hf_config(path)
    model = build_model(cfg, path, dtype)
    packed = [n for n, m in model.named_modules() if _is_packed(m)]
    assert len(packed) == EXPECTED_PACKED[arch]
    assert not any(isinstance(m, nn.Linear) and not _is_packed(m) for m in model.modules())
    assert _is_packed(model.lm_head)
    # A tied head's packed copy leaves the embedding its plain weight.
    assert type(model.model.embed_tokens) is nn.Embedding
    assert model.model.embed_tokens.weight.dtype == dtype

    # The reference twin: disabled, nothing is packed; fp16 is never packed.
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    plain = build_model(cfg, path, dtype)
    assert not any(_is_packed(m) for m in plain.modules())
    monkeypatch.delenv(PACKED_LINEAR_ENV)
    fp16 = build_model(cfg, path, torch.float16)
    assert not any(_is_packed(m) for m in fp16.modules())


def _greedy(path: str, dtype: torch.dtype) -> tuple[int, list[list[int]], list[list[float]]]:
    """(packed modules in the engine's model, greedy tokens, their logprobs) for PROMPTS."""
    llm = LLM(path, dtype=dtype, num_kv_blocks=256)
    model = llm.llm_engine.engine_core.model_runner.model  # in-process engine core (DP=1)
    num_packed = sum(_is_packed(m) for m in model.modules())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    return num_packed, tokens, logprobs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", sorted(EXPECTED_PACKED))
def test_packed_model_generates_like_plain(arch, dtype, model_dir, monkeypatch):
    """Greedy generation (batched prefill, MLA prefill via kv_b_proj and absorbed decode)
    gives the same tokens with packed and plain linears, and nearly the same logprobs."""
    path = model_dir(arch)
    monkeypatch.setenv(PACKED_LINEAR_ENV, "1")
    num_packed, packed_tokens, packed_lp = _greedy(path, dtype)
    assert num_packed == EXPECTED_PACKED[arch]
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    num_plain, plain_tokens, plain_lp = _greedy(path, dtype)
    assert num_plain == 0
    assert packed_tokens == plain_tokens
    # bf16: identical on the AMX machine this was written on; rounding may differ elsewhere.
    for a, b in zip(packed_lp, plain_lp):
        assert a == pytest.approx(b, abs=LOGPROB_TOL[dtype])


@needs_onednn
def test_warm_packed_linears_calls_one_module_per_shape():
    """Two linears of one shape and one of another: each row count runs once per shape, on
    the first module of that shape; plain linears are skipped."""
    same_a, same_b, other = _packed_copy(_linear(False, 0)), _packed_copy(_linear(False, 1)), \
        _packed_copy(_linear(True, 2))
    plain = Linear(IN_FEATURES, OUT_FEATURES, dtype=torch.float16)
    seen: list[tuple[str, int]] = []
    for name, m in (("a", same_a), ("b", same_b), ("other", other)):
        m.register_forward_hook(lambda mod, args, out, name=name: seen.append(
            (name, args[0].shape[0])))
    calls = warm_packed_linears([same_a, plain, same_b, other], [16, 48])
    assert calls == 4
    assert seen == [("a", 16), ("other", 16), ("a", 48), ("other", 48)]
    assert warm_packed_linears([plain], [16]) == 0


@needs_onednn
def test_runner_warms_each_padded_prompt_size_once(model_dir):
    """The serving loop's idle warm-up: every padded prompt-step size below the budget (which
    start-up ran), smallest first, through one decoder linear of each shape and never the LM
    head. Padding never goes past the budget."""
    llm = LLM(model_dir("LlamaForCausalLM"), dtype=PACK_DTYPE, num_kv_blocks=64,
              max_model_len=256, max_num_batched_tokens=100, prefill_pad_multiple=32)
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.sizes_to_warm == [32, 64, 96]
    assert [runner._padded_num_tokens(n) for n in (1, 32, 33, 96, 97, 100)] == \
        [32, 32, 64, 96, 100, 100]
    model = runner.model
    calls: dict[tuple[int, int], list[int]] = {}
    head_calls: list[int] = []
    for m in model.modules():
        if _is_packed(m) and m is not model.lm_head:
            m.register_forward_hook(lambda mod, args, out: calls.setdefault(
                (mod.in_features, mod.out_features), []).append(args[0].shape[0]))
    model.lm_head.register_forward_hook(lambda mod, args, out: head_calls.append(1))
    while runner.sizes_to_warm:
        runner.warm_next_size()
    runner.warm_next_size()  # nothing left: a no-op
    shapes = {(m.in_features, m.out_features) for m in model.modules()
              if _is_packed(m) and m is not model.lm_head}
    assert set(calls) == shapes and not head_calls
    assert all(rows == [32, 64, 96] for rows in calls.values())
