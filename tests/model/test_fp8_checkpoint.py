"""DeepSeek-V3 FP8 checkpoints end to end: ``preset:deepseek-v3-tiny-fp8`` is written in
exactly DeepSeek's format, and widellm's greedy output on it equals transformers' on the same
checkpoint dequantized to fp32 (an ordinary checkpoint without quantization_config)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import hf_greedy
from tests.dist_utils import run_ranks
from widellm import LLM, SamplingParams
from widellm.distributed.ep_context import ExpertParallelContext
from widellm.layers.moe.layer import FusedMoE
from widellm.model import loader
from widellm.model.preset_writer import write_checkpoint
from widellm.model.presets import PRESETS, resolve_preset
from widellm.worker import model_runner

FP8_PRESET = "deepseek-v3-tiny-fp8"
TWIN_PRESET = "deepseek-v3-tiny"
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
# DeepSeek-V3's config.json entry, verbatim.
DEEPSEEK_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
# The linears DeepSeek-V3 ships in FP8 (MLA projections, dense/shared/routed expert MLPs).
ATTENTION_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
# A wider variant: hidden 256 (2 full blocks along every input), intermediate 384 (3 blocks),
# expert width 160 and q LoRA 192 (a full block plus a partial one).
WIDE_OVERRIDES = {
    "hidden_size": 256, "intermediate_size": 384, "moe_intermediate_size": 160,
    "q_lora_rank": 192,
}
PROMPT_LENS = (5, 17, 40, 90)
MAX_NEW_TOKENS = 16
EP_SIZE = 2
EP_TIMEOUT_S = 120.0
EP_MAX_TOKENS = 64


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("fp8-presets"))


@pytest.fixture(scope="module")
def fp8_folder(cache_dir) -> str:
    return resolve_preset(f"preset:{FP8_PRESET}", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def wide_fp8_folder(tmp_path_factory) -> str:
    spec = PRESETS[FP8_PRESET]
    spec = dataclasses.replace(spec, config_kwargs={**spec.config_kwargs, **WIDE_OVERRIDES})
    folder = str(tmp_path_factory.mktemp("wide-fp8"))
    write_checkpoint(spec, folder)
    return folder


def read_config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def dequantize_by_hand(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Each scale repeated over its 128 x 128 block, cut to the weight's shape (an
    independent spelling of the format, not widellm's function)."""
    out, inp = q.shape
    full = scale_inv.repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :inp]
    return q.to(torch.float32) * full


def write_dequantized_copy(fp8_folder: str, dst: str) -> str:
    """The FP8 checkpoint as an ordinary fp32 one: same tokenizer and config minus
    quantization_config, every FP8 weight dequantized and every scale dropped."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(fp8_folder):
        if name not in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(fp8_folder, name), dst)
    config = read_config(fp8_folder)
    del config["quantization_config"]
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    tensors = load_file(os.path.join(fp8_folder, "model.safetensors"))
    plain = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize_by_hand(t, tensors[name + SCALE_SUFFIX])
        plain[name] = t
    save_file(plain, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def expected_fp8_names(config: dict) -> set[str]:
    """Checkpoint names DeepSeek-V3 stores in FP8, spelled out from the config."""
    names = set()
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        names |= {f"{prefix}.self_attn.{p}.weight" for p in ATTENTION_LINEARS}
        if i < config["first_k_dense_replace"]:
            names |= {f"{prefix}.mlp.{p}.weight" for p in MLP_LINEARS}
            continue
        names |= {f"{prefix}.mlp.shared_experts.{p}.weight" for p in MLP_LINEARS}
        names |= {f"{prefix}.mlp.experts.{e}.{p}.weight"
                  for e in range(config["n_routed_experts"]) for p in MLP_LINEARS}
    return names


@pytest.mark.parametrize("which", ["preset", "wide"])
def test_files_are_deepseek_fp8(which, request):
    folder = request.getfixturevalue("fp8_folder" if which == "preset" else "wide_fp8_folder")
    config = read_config(folder)
    assert config["quantization_config"] == DEEPSEEK_QUANTIZATION_CONFIG
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    fp8_names = expected_fp8_names(config)
    scale_names = {n + SCALE_SUFFIX for n in fp8_names}
    assert set(tensors) >= fp8_names | scale_names
    multi_block = 0
    for name, t in tensors.items():
        if name in fp8_names:
            assert t.dtype == torch.float8_e4m3fn, name
            scale = tensors[name + SCALE_SUFFIX]
            assert scale.dtype == torch.float32, name
            grid = (math.ceil(t.shape[0] / BLOCK), math.ceil(t.shape[1] / BLOCK))
            assert tuple(scale.shape) == grid, name
            multi_block += grid != (1, 1)
        elif name not in scale_names:
            # Embeddings, norms, router gate and its bias, lm_head: left as saved.
            assert t.dtype == torch.float32, name
    assert multi_block > 0
    unquantized = (
        "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
        "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
    )
    for name in unquantized:
        assert name in tensors and name + SCALE_SUFFIX not in tensors, name


def test_preset_is_the_tiny_twin_quantized(fp8_folder, cache_dir):
    """Same config and weights as deepseek-v3-tiny; each FP8 block's amax maps to 448 and its
    values are the twin's weights divided by the block scale, rounded to e4m3."""
    twin = resolve_preset(f"preset:{TWIN_PRESET}", cache_dir=cache_dir)
    fp8_config, twin_config = read_config(fp8_folder), read_config(twin)
    assert {k: v for k, v in fp8_config.items() if k != "quantization_config"} == twin_config
    fp8 = load_file(os.path.join(fp8_folder, "model.safetensors"))
    plain = load_file(os.path.join(twin, "model.safetensors"))
    assert {n for n in fp8 if not n.endswith(SCALE_SUFFIX)} == set(plain)
    for name, w in plain.items():
        if fp8[name].dtype != torch.float8_e4m3fn:
            assert torch.equal(fp8[name], w), name
            continue
        scale = fp8[name + SCALE_SUFFIX]
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
                block = w[rows, cols]
                assert scale[i, j] == block.abs().max() / 448.0, name
                expected = (block / scale[i, j]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
                got = fp8[name][rows, cols]
                assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name


def make_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4321)
    # Skip the lowest ids: the presets' special tokens live there.
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def tokens_and_logprobs(outs) -> tuple[list[list[int]], list[list[float]]]:
    """Each output's token ids and the logprob of each (requests made with ``logprobs=1``)."""
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    return tokens, logprobs


def dequantized_then_kept_runs(folder, prompts, params, monkeypatch, inspect):
    """Generate (fp32) with the FP8 checkpoint dequantized at load (CPU's default), then with
    its FP8 weights kept (forced; the dequant kernel); each run gives (inspect(model), token
    ids, logprobs)."""
    def run():
        llm = LLM(folder, dtype="float32", num_kv_blocks=128)
        model = llm.llm_engine.engine_core.model_runner.model
        return (inspect(model), *tokens_and_logprobs(llm.generate(prompts, params,
                                                                  use_tqdm=False)))

    dequantized = run()
    monkeypatch.setattr(model_runner, "build_model", functools.partial(
        loader.build_model, keep_fp8=True, fp8_kernel="dequant"))
    return dequantized, run()


@pytest.mark.parametrize("which", ["preset", "wide"])
def test_greedy_equals_transformers_on_dequantized_copy(which, request, tmp_path):
    fp8_folder = request.getfixturevalue("fp8_folder" if which == "preset" else "wide_fp8_folder")
    prompts = make_prompts(read_config(fp8_folder)["vocab_size"])
    plain = write_dequantized_copy(fp8_folder, str(tmp_path / "dequantized"))
    expected = hf_greedy(plain, prompts, MAX_NEW_TOKENS)

    llm = LLM(fp8_folder, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    # Not a degenerate model: the continuations differ from prompt to prompt.
    assert len({tuple(t) for t in got}) == len(prompts)


def _load_fp8_on_rank(rank: int, world_size: int, path: str) -> tuple[list[str], dict]:
    """Build the FP8 model as one EP rank; (checkpoint names read, routed-expert params)."""
    ep = ExpertParallelContext(rank, world_size, None, "all2all", None, EP_MAX_TOKENS)
    read: list[str] = []
    original = loader.iterate_weights

    def recording(p, skip=None):
        for name, tensor in original(p, skip):
            read.append(name)
            yield name, tensor

    loader.iterate_weights = recording  # this rank's process only
    model = loader.build_model(loader.load_hf_config(path), path, torch.float32, ep)
    experts = {f"{n}.{p}": t.detach().clone() for n, m in model.named_modules()
               if isinstance(m, FusedMoE) for p, t in m.named_parameters(recurse=False)}
    return read, experts


def test_expert_parallel_ranks_read_only_their_experts_and_scales(fp8_folder):
    full = loader.build_model(loader.load_hf_config(fp8_folder), fp8_folder, torch.float32)
    full_experts = {f"{n}.{p}": t for n, m in full.named_modules()
                    if isinstance(m, FusedMoE) for p, t in m.named_parameters(recurse=False)}
    num_experts = read_config(fp8_folder)["n_routed_experts"]
    per_rank = num_experts // EP_SIZE
    results = run_ranks(_load_fp8_on_rank, EP_SIZE, fp8_folder, timeout_s=EP_TIMEOUT_S)
    for rank, (read, experts) in enumerate(results):
        routed = [n for n in read if ".experts." in n and "shared_experts" not in n]
        ids = {int(n.split(".experts.")[1].split(".")[0]) for n in routed}
        assert ids == set(range(rank * per_rank, (rank + 1) * per_rank))
        # Every routed weight read came with its scale, and nothing else.
        weights = {n for n in routed if not n.endswith(SCALE_SUFFIX)}
        scales = {n for n in routed if n.endswith(SCALE_SUFFIX)}
        assert scales == {w + SCALE_SUFFIX for w in weights}
        assert experts.keys() == full_experts.keys()
        for name, t in experts.items():
            assert torch.equal(t, full_experts[name][rank * per_rank:(rank + 1) * per_rank]), name
