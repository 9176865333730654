"""Shared fixtures: tiny random checkpoints generated into a per-session folder, and the
Hugging Face reference outputs they are compared against."""

from __future__ import annotations

import os

import pytest
import torch

# Without CUDA the Triton kernels (tests/ops/triton) run in Triton's interpreter. The variable
# must be set before triton is first imported, by anything (torch's compiler imports it too):
# triton decorates its own language functions (tl.cdiv, ...) then, and compiled ones cannot be
# called from an interpreted kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from widellm.model.presets import resolve_preset
from widellm.ops.cpu_kernels import load_cpu_kernels

# Every architecture the engine supports, as the tiny preset that exercises it.
TINY_MODELS = {
    "LlamaForCausalLM": "preset:llama-tiny",
    "Qwen2ForCausalLM": "preset:qwen2-tiny",
    "MixtralForCausalLM": "preset:mixtral-tiny",
    "Qwen2MoeForCausalLM": "preset:qwen2-moe-tiny",
    "Qwen3MoeForCausalLM": "preset:qwen3-moe-tiny",
    "DeepseekV2ForCausalLM": "preset:deepseek-v2-tiny",
    "DeepseekV3ForCausalLM": "preset:deepseek-v3-tiny",
}


def pytest_sessionstart(session):
    """Build the CPU kernels once, before any test (a no-op where they are disabled or cannot
    be built). On a fresh machine the build takes ~2.5 min on 2 cores; without this the first
    server or engine process a test starts would compile them inside its start-up timeout."""
    load_cpu_kernels()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """arch -> checkpoint folder, generated on first use into the session's temp dir."""
    root = tmp_path_factory.mktemp("models")
    cache: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in cache:
            cache[arch] = resolve_preset(TINY_MODELS[arch], cache_dir=str(root))
        return cache[arch]

    return get


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers' own implementation, one prompt at a time (no
    padding, so nothing but the model itself can differ), fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Like ignore_eos: EOS is an ordinary token (min_new_tokens would instead forbid it).
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            seq = model.generate(
                torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=0,
            )
            outs.append(seq[0, len(p):].tolist())
    return outs
