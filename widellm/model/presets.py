"""Named random-weight models for tests and benchmarks.

A preset is a recipe (a Hugging Face config class, its keyword arguments and a seed) that turns
into an ordinary Hugging Face checkpoint folder on first use: ``config.json``,
``generation_config.json``, ``model.safetensors`` and a small byte-level BPE tokenizer
(``tokenizer.json`` + ``tokenizer_config.json``). Anything that takes a model path can take
``"preset:<name>"`` once it calls :func:`resolve_preset`, and other engines (vLLM, plain
transformers) can load the resulting folder unchanged, which is what makes the presets usable
as shared benchmark and test models.

Folders are cached under ``$WIDELLM_CACHE_DIR/presets`` (default ``~/.cache/widellm/presets``),
named ``<name>-<hash>`` where the hash covers the whole spec plus the generator and transformers
versions, so editing a recipe never serves stale weights. Generation writes into a temporary
sibling folder and renames it into place, so concurrent processes never see a half-written
model and the loser of a race simply uses the winner's folder.

Presets ending in ``-skewed`` (``deepseek-v3-tiny-skewed``, ``deepseek-v3-small-skewed``) have
the weights of their unskewed twin except for a router score-correction bias that makes a few
experts hot (``PresetSpec.router_skew``), so expert-parallel load balancing has work to do.

Run ``python -m widellm.model.presets preset:deepseek-v3-small`` to print (and create) a
preset's folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from widellm.model.flops import flops_per_token
from widellm.model.preset_spec import PresetSpec
from widellm.model.preset_tokenizer import SPECIAL_TOKEN_IDS
from widellm.model.preset_writer import DEFAULT_ROUTER_SKEW, skew_profile, write_checkpoint

PRESET_PREFIX = "preset:"
CACHE_DIR_ENV = "WIDELLM_CACHE_DIR"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "widellm")
PRESETS_SUBDIR = "presets"
GIGA = 1e9

# Bump when the generation code changes what a given spec produces (init, tokenizer, files).
GENERATOR_VERSION = 1
HASH_CHARS = 12

# Keyword arguments shared by every "-tiny" preset: small enough that building, saving and
# loading take well under a second, big enough for multi-head attention and batched tests.
_TINY_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "max_position_embeddings": 2048,
    **SPECIAL_TOKEN_IDS,
}

# Non-MLA tiny models use 32-wide heads: the smallest head size vLLM's CPU attention accepts,
# so these presets can be cross-checked against vLLM as well as transformers.
_TINY_GQA: dict[str, Any] = {
    **_TINY_COMMON,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_key_value_heads": 2,
}

# The DeepSeek routing fields that transformers' DeepseekV3Config does not keep but real
# DeepSeek-V3 checkpoints (and vLLM) rely on.
_DEEPSEEK_V3_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}

_DEEPSEEK_V3_TINY_KWARGS: dict[str, Any] = {
    **_TINY_COMMON,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_key_value_heads": 4,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "num_mtp_layers": 0,
}
_DEEPSEEK_V3_TINY_DESCRIPTION = (
    "DeepSeek-V3 MLA+MoE, 3 layers (1 dense), 16 experts top-4, sigmoid noaux_tc routing, fp32"
)
_DEEPSEEK_V3_SMALL_DESCRIPTION = (
    "DeepSeek-V3 shape for benchmarks: hidden 1024, 8 layers (1 dense), "
    "64 experts top-6 + 1 shared, MLA kv_lora 512; ~0.31 GFLOP/token, bf16"
)
_SKEWED_DESCRIPTION = (
    "; skewed router (router_skew {skew:g}): hot experts on the first EP2/EP4 rank, "
    "balancedness <0.6, for EPLB"
)

_DEEPSEEK_V3_SMALL_KWARGS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "moe_intermediate_size": 384,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "q_lora_rank": 512,
    # DeepSeek-V3's own MLA sizes: vLLM's CPU MLA backend only supports these.
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "max_position_embeddings": 4096,
    "num_mtp_layers": 0,
    **SPECIAL_TOKEN_IDS,
}

_DEEPSEEK_V3_TINY = PresetSpec(
    config_class="DeepseekV3Config",
    model_class="DeepseekV3ForCausalLM",
    config_kwargs=_DEEPSEEK_V3_TINY_KWARGS,
    seed=0,
    extra_config=_DEEPSEEK_V3_ROUTING,
    description=_DEEPSEEK_V3_TINY_DESCRIPTION
    + "; see deepseek-v3-tiny-skewed for unbalanced expert load",
)
_DEEPSEEK_V3_SMALL = PresetSpec(
    config_class="DeepseekV3Config",
    model_class="DeepseekV3ForCausalLM",
    config_kwargs=_DEEPSEEK_V3_SMALL_KWARGS,
    seed=0,
    dtype="bfloat16",
    extra_config=_DEEPSEEK_V3_ROUTING,
    description=_DEEPSEEK_V3_SMALL_DESCRIPTION
    + "; see deepseek-v3-small-skewed for unbalanced expert load",
)


def _skewed(twin: PresetSpec, description: str) -> PresetSpec:
    """``twin`` with the default router skew (same config, seed and other weights)."""
    return dataclasses.replace(
        twin, router_skew=DEFAULT_ROUTER_SKEW,
        description=description + _SKEWED_DESCRIPTION.format(skew=DEFAULT_ROUTER_SKEW),
    )


PRESETS: Mapping[str, PresetSpec] = MappingProxyType(
    {
        "deepseek-v3-tiny": _DEEPSEEK_V3_TINY,
        "deepseek-v3-small": _DEEPSEEK_V3_SMALL,
        # Same weights as the twins above (same config and seed); only the score-correction
        # bias differs, which makes expert load unbalanced for EPLB tests and benchmarks.
        "deepseek-v3-tiny-skewed": _skewed(_DEEPSEEK_V3_TINY, _DEEPSEEK_V3_TINY_DESCRIPTION),
        "deepseek-v3-small-skewed": _skewed(_DEEPSEEK_V3_SMALL, _DEEPSEEK_V3_SMALL_DESCRIPTION),
        # deepseek-v3-tiny's weights in DeepSeek-V3's own FP8 checkpoint format.
        "deepseek-v3-tiny-fp8": dataclasses.replace(
            _DEEPSEEK_V3_TINY, quantization="fp8",
            description="deepseek-v3-tiny in DeepSeek-V3's FP8 format: float8_e4m3fn linears "
            "with 128x128-block weight_scale_inv, quantization_config in config.json",
        ),
        "deepseek-v2-tiny": PresetSpec(
            config_class="DeepseekV2Config",
            model_class="DeepseekV2ForCausalLM",
            config_kwargs={
                **_TINY_COMMON,
                "moe_intermediate_size": 32,
                "num_hidden_layers": 3,
                "first_k_dense_replace": 1,
                "num_key_value_heads": 4,
                "n_routed_experts": 16,
                "num_experts_per_tok": 4,
                "n_shared_experts": 2,
                "n_group": 4,
                "topk_group": 2,
                "topk_method": "group_limited_greedy",
                "q_lora_rank": None,
                "kv_lora_rank": 32,
                "qk_rope_head_dim": 16,
                "qk_nope_head_dim": 32,
                "v_head_dim": 32,
            },
            seed=0,
            extra_config={"scoring_func": "softmax"},
            description="DeepSeek-V2 MLA (no q_lora) + MoE, softmax group_limited_greedy "
            "routing, 16 experts top-4, fp32",
        ),
        "qwen3-moe-tiny": PresetSpec(
            config_class="Qwen3MoeConfig",
            model_class="Qwen3MoeForCausalLM",
            config_kwargs={
                **_TINY_GQA,
                "moe_intermediate_size": 32,
                "num_hidden_layers": 2,
                "head_dim": 32,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "norm_topk_prob": True,
            },
            seed=0,
            description="Qwen3-MoE, 2 layers, hidden 128, 8 experts top-2, "
            "GQA 4/2 heads of 32, fp32",
        ),
        "qwen2-moe-tiny": PresetSpec(
            config_class="Qwen2MoeConfig",
            model_class="Qwen2MoeForCausalLM",
            config_kwargs={
                **_TINY_GQA,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_experts": 8,
                "num_experts_per_tok": 2,
            },
            seed=0,
            description="Qwen2-MoE, 2 layers, hidden 128, 8 experts top-2 + gated shared "
            "expert, fp32",
        ),
        "mixtral-tiny": PresetSpec(
            config_class="MixtralConfig",
            model_class="MixtralForCausalLM",
            config_kwargs={
                **_TINY_GQA,
                "num_hidden_layers": 2,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
            },
            seed=0,
            description="Mixtral, 2 layers, hidden 128, 8 experts top-2, GQA 4/2 heads of 32, "
            "fp32",
        ),
        "llama-tiny": PresetSpec(
            config_class="LlamaConfig",
            model_class="LlamaForCausalLM",
            config_kwargs={
                **_TINY_GQA,
                "num_hidden_layers": 2,
                "tie_word_embeddings": True,
            },
            seed=0,
            description="Llama dense, 2 layers, hidden 128, GQA 4/2 heads of 32, tied "
            "embeddings, fp32",
        ),
        "qwen2-tiny": PresetSpec(
            config_class="Qwen2Config",
            model_class="Qwen2ForCausalLM",
            config_kwargs={
                **_TINY_GQA,
                "num_hidden_layers": 2,
            },
            seed=0,
            description="Qwen2 dense (qkv bias), 2 layers, hidden 128, GQA 4/2 heads of 32, fp32",
        ),
    }
)


def is_preset(name: str) -> bool:
    """True when ``name`` is a ``"preset:<name>"`` model reference (known or not)."""
    return isinstance(name, str) and name.startswith(PRESET_PREFIX)


def _preset_name(name: str) -> str:
    """Strip the ``preset:`` prefix and check the name is known."""
    bare = name[len(PRESET_PREFIX):] if is_preset(name) else name
    if bare not in PRESETS:
        known = ", ".join(sorted(PRESETS))
        raise KeyError(f"unknown preset {name!r}; known presets: {known}")
    return bare


def get_preset(name: str) -> PresetSpec:
    """The spec for ``"preset:<name>"`` or a bare ``"<name>"``."""
    return PRESETS[_preset_name(name)]


def spec_hash(spec: PresetSpec) -> str:
    """Short content hash of a spec together with everything else that shapes its files."""
    import transformers

    payload = {
        "spec": spec.to_json_dict(),
        "generator_version": GENERATOR_VERSION,
        # Init order or serialisation may change between transformers releases.
        "transformers": transformers.__version__,
    }
    if spec.router_skew:
        # The skew recipe lives in module constants; editing them must not serve stale weights.
        payload["router_skew_profile"] = skew_profile()
    if spec.quantization:
        from widellm.model.presets_fp8 import quantization_recipe

        payload["quantization_recipe"] = quantization_recipe(spec.quantization)
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:HASH_CHARS]


def default_cache_dir() -> str:
    """``$WIDELLM_CACHE_DIR`` or ``~/.cache/widellm``."""
    return os.path.expanduser(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


def resolve_preset(name: str, cache_dir: str | None = None) -> str:
    """Return the checkpoint folder of a preset, generating it on first use.

    Args:
        name: ``"preset:<name>"`` (or the bare name).
        cache_dir: root cache folder; defaults to :func:`default_cache_dir`.

    Returns:
        Absolute path of a folder loadable with ``AutoConfig``/``AutoTokenizer``/
        ``AutoModelForCausalLM.from_pretrained``.
    """
    bare = _preset_name(name)
    spec = PRESETS[bare]
    root = os.path.join(os.path.abspath(cache_dir or default_cache_dir()), PRESETS_SUBDIR)
    final = os.path.join(root, f"{bare}-{spec_hash(spec)}")
    if os.path.isdir(final):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{bare}.tmp-", dir=root)
    try:
        write_checkpoint(spec, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first; its folder is equivalent, keep it.
            if not os.path.isdir(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def preset_flops_per_token(name: str) -> float:
    """:func:`flops_per_token` of a preset, without generating its weights."""
    import transformers

    spec = get_preset(name)
    config = getattr(transformers, spec.config_class)(**spec.config_kwargs)
    return flops_per_token(config)


def main(argv: list[str] | None = None) -> int:
    """CLI: print the folder of each named preset (generating it), or list them all."""
    names = sys.argv[1:] if argv is None else argv
    if not names:
        for key, spec in PRESETS.items():
            gflops = preset_flops_per_token(key) / GIGA
            print(f"{PRESET_PREFIX}{key}\t{gflops:.3f} GFLOP/token\t{spec.description}")
        return 0
    for name in names:
        print(resolve_preset(name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
