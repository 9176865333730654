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

PRESET_PREFIX = "preset:"
CACHE_DIR_ENV = "WIDELLM_CACHE_DIR"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "widellm")
PRESETS_SUBDIR = "presets"

# Bump when the generation code changes what a given spec produces (init, tokenizer, files).
GENERATOR_VERSION = 1
HASH_CHARS = 12

# HF initialises the DeepSeek-V3 score-correction bias to zeros, which would leave the
# bias-for-selection path untested; this scale is comparable to the spread of sigmoid router
# scores of a randomly initialised router, so the bias really changes some selections.
SCORE_BIAS_STD = 0.02
# Offset the bias generator's seed from the weight seed so the two streams are independent.
SCORE_BIAS_SEED_OFFSET = 1

# Router skew (PresetSpec.router_skew), for presets whose expert load must be unbalanced so that
# expert-parallel load balancing has something to fix. A random router spreads tokens fairly
# evenly (contiguous EP2/EP4 balancedness of the unskewed DeepSeek-V3 presets: ~0.55-0.98,
# uneven only through their small random bias and correlated hidden states); the skew adds to the DeepSeek-V3 score-correction bias (selection only, gate values stay the
# model's own) ``router_skew * unit * heat[e]``, where ``unit`` is the spread of the sigmoid
# router scores (sigmoid'(0) = 1/4 times the mean gate-row norm, the logit std for a unit-RMS
# normed input) and ``heat`` is:
#   * SKEW_WARM on the first half of the experts: their groups win group-limited routing, so
#     contiguous EP2 placement puts nearly all the load on rank 0;
#   * plus SKEW_BLOCK on the first quarter, the slots of EP4 rank 0, so that rank gets most
#     of the load under EP4 as well;
#   * plus SKEW_HOT on max(1, top_k // 2) hot experts drawn (seeded, per layer) from that
#     first quarter. The load stays spread over several experts, each well under half of the
#     selections (and no expert is chosen by every token), so a replica-based balancer can
#     even it out.
SKEW_WARM = 1.0
SKEW_BLOCK = 0.25
SKEW_HOT = 0.5
# Sigmoid slope at 0: converts a logit spread into a score spread.
SIGMOID_SLOPE = 0.25
# Parts of the expert range: the block and hot experts are in the first 1/SKEW_HOT_SPAN_DIV,
# the warm ones are the first 1/SKEW_WARM_SPAN_DIV.
SKEW_HOT_SPAN_DIV = 4
SKEW_WARM_SPAN_DIV = 2
SKEW_SEED_OFFSET = 2
# Skew of the "-skewed" presets: EP2 balancedness (mean/max tokens per rank) ~0.5, EP4 ~0.3-0.4.
DEFAULT_ROUTER_SKEW = 2.0

BOS_TOKEN = "<|bos|>"
# GPT-2's end-of-text name: transformers forces Qwen2Tokenizer onto qwen2 checkpoints, and that
# class adds "<|endoftext|>" as its unknown token unless the vocabulary already has it.
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
BOS_ID, EOS_ID, PAD_ID = range(len(SPECIAL_TOKENS))
SPECIAL_TOKEN_IDS = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
FILLER_TOKEN = "<filler{}>"
BYTE_ALPHABET_SIZE = 256
GIGA = 1e9
TOKENIZER_CONFIG_OVERRIDES = {"tokenizer_class": "PreTrainedTokenizerFast"}
DIR_MODE = 0o755
FILE_MODE = 0o644

# A minimal role-tagged chat template so chat endpoints work with preset tokenizers.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Original text the tokenizer's merges are learned from; it only has to be fixed and varied
# enough to give a few hundred merges, so tokenizer output looks like real subword text.
TOKENIZER_CORPUS = """\
The engine keeps a pool of fixed-size blocks for the key and value cache. Every request owns
a list of blocks, and a block that holds a full chunk of tokens gets a hash chained to the hash
of the block before it, so two prompts that start the same way can share their first blocks.
When memory runs short the scheduler preempts the request it admitted last and computes it
again later. Sparse mixture-of-experts models route each token to a few experts out of many;
the router scores every expert, picks the best groups, then the best experts inside them, and
scales the chosen weights. Wide expert parallelism spreads the experts over many ranks while
attention stays data parallel, and tokens travel to their experts and back in every layer.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128, 256, 512 and 1024 appear
often in configuration files, and so do words like hidden, size, layers, heads, rank, rope,
vocabulary, position, embedding, normalisation, activation and intermediate.
Quick brown foxes jump over lazy dogs; a wizard's job is to vex chumps quickly in fog.
Questions? Answers! Lists: apples, pears, plums; paths like /tmp/cache/model.safetensors;
code like def forward(self, x): return self.proj(x) * 2 + 1; JSON like {"key": [1, 2]}.
"""


@dataclasses.dataclass(frozen=True)
class PresetSpec:
    """Recipe for one random-weight model.

    Attributes:
        config_class: name of the transformers config class, e.g. ``"DeepseekV3Config"``.
        model_class: name of the transformers causal-LM class built from that config.
        config_kwargs: keyword arguments for the config class (vocab size included).
        seed: torch seed used before building the model, which fixes every weight.
        dtype: dtype of the saved weights (``"float32"`` or ``"bfloat16"``).
        extra_config: keys merged into config.json after saving, for fields real checkpoints
            carry that the transformers config class drops (e.g. DeepSeek-V3's topk_method).
        description: one line for humans and ``--help`` listings.
        router_skew: 0 (default) for a plain random router; > 0 makes a few experts hot
            through the DeepSeek-V3 score-correction bias (see :data:`SKEW_WARM`), in units of
            the router-score spread. DeepSeek-V3 (``e_score_correction_bias``) models only.
        quantization: None (default) for plain weights; ``"fp8"`` rewrites the saved
            checkpoint into DeepSeek-V3's block FP8 format (``presets_fp8.py``).
    """

    config_class: str
    model_class: str
    config_kwargs: Mapping[str, Any]
    seed: int = 0
    dtype: str = "float32"
    extra_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    description: str = ""
    router_skew: float = 0.0
    quantization: str | None = None

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the model and of its generated tokenizer."""
        return int(self.config_kwargs["vocab_size"])

    def to_json_dict(self) -> dict[str, Any]:
        """Plain-dict form used for hashing (and handy for logging)."""
        out = {
            "config_class": self.config_class,
            "model_class": self.model_class,
            "config_kwargs": dict(self.config_kwargs),
            "seed": self.seed,
            "dtype": self.dtype,
            "extra_config": dict(self.extra_config),
        }
        # Only when set, so unskewed presets keep their hashes (and cached folders).
        if self.router_skew:
            out["router_skew"] = self.router_skew
        if self.quantization:
            out["quantization"] = self.quantization
        return out


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
        payload["router_skew_profile"] = [
            SKEW_WARM, SKEW_BLOCK, SKEW_HOT, SKEW_HOT_SPAN_DIV, SKEW_WARM_SPAN_DIV, SKEW_SEED_OFFSET
        ]
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


def write_checkpoint(spec: PresetSpec, folder: str) -> None:
    """Build the model and tokenizer of ``spec`` and save them into ``folder``."""
    import torch
    import transformers

    config = getattr(transformers, spec.config_class)(**spec.config_kwargs)
    model_cls = getattr(transformers, spec.model_class)
    # Build under a private RNG state so generating a preset never disturbs the caller's
    # seeded random stream (tests rely on their own seeds).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = model_cls(config)
    model = model.to(getattr(torch, spec.dtype)).eval()
    _randomize_score_bias(model, spec.seed)
    if spec.router_skew:
        _skew_router(model, config, spec.router_skew, spec.seed)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(folder)
    _merge_json(os.path.join(folder, "config.json"), spec.extra_config)
    if spec.quantization:
        from widellm.model.presets_fp8 import quantize_checkpoint

        quantize_checkpoint(folder, spec.quantization)
    max_length = spec.config_kwargs.get("max_position_embeddings")
    tokenizer = build_tokenizer(spec.vocab_size, model_max_length=max_length)
    tokenizer.save_pretrained(folder)
    # transformers 5 writes its own backend name here, which 4.x cannot resolve; the
    # PreTrainedTokenizerFast name loads in both.
    _merge_json(os.path.join(folder, "tokenizer_config.json"), TOKENIZER_CONFIG_OVERRIDES)
    _make_readable(folder)


def _randomize_score_bias(model: Any, seed: int) -> None:
    """Give every DeepSeek-V3 ``e_score_correction_bias`` small nonzero random values.

    The bias stays float32 whatever the weight dtype, as in real DeepSeek-V3 checkpoints:
    it is added to router scores in float32 and bf16 would round small values away.
    """
    import torch

    generator = torch.Generator().manual_seed(seed + SCORE_BIAS_SEED_OFFSET)
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            values = torch.randn(bias.shape, generator=generator, dtype=torch.float32)
            module.e_score_correction_bias = values * SCORE_BIAS_STD


def skew_heat(num_experts: int, top_k: int, generator: Any) -> Any:
    """Per-expert heat of one MoE layer (see :data:`SKEW_WARM`), in router-score units.

    Args:
        num_experts: routed experts of the layer.
        top_k: experts per token.
        generator: torch generator that picks this layer's hot experts.

    Returns:
        ``[num_experts]`` float32: SKEW_WARM on the first half, plus SKEW_BLOCK on the first
        quarter, plus SKEW_HOT on ``max(1, top_k // 2)`` experts of the first quarter.
    """
    import torch

    heat = torch.zeros(num_experts, dtype=torch.float32)
    heat[: max(1, num_experts // SKEW_WARM_SPAN_DIV)] = SKEW_WARM
    hot_span = max(1, num_experts // SKEW_HOT_SPAN_DIV)
    heat[:hot_span] += SKEW_BLOCK
    num_hot = min(hot_span, max(1, top_k // 2))
    hot = torch.randperm(hot_span, generator=generator)[:num_hot]
    heat[hot] += SKEW_HOT
    return heat


def _skew_router(model: Any, config: Any, skew: float, seed: int) -> None:
    """Add the router skew of :data:`SKEW_WARM` to every score-correction bias, in place.

    Each MoE layer draws its own hot experts from one seeded stream, in layer order.
    """
    import torch

    generator = torch.Generator().manual_seed(seed + SKEW_SEED_OFFSET)
    gates = [
        module
        for module in model.modules()
        if isinstance(getattr(module, "e_score_correction_bias", None), torch.Tensor)
    ]
    if not gates:
        raise ValueError(
            "router_skew needs a router with an e_score_correction_bias (DeepSeek-V3 models)"
        )
    for gate in gates:
        # Router scores are sigmoid(w_e . x) with x unit-RMS (RMSNorm output), so the logit
        # spread is about |w_e| and the score spread SIGMOID_SLOPE * |w_e|.
        unit = SIGMOID_SLOPE * float(gate.weight.detach().float().norm(dim=1).mean())
        bias = gate.e_score_correction_bias
        heat = skew_heat(bias.shape[0], config.num_experts_per_tok, generator)
        gate.e_score_correction_bias = bias.float() + skew * unit * heat


def _merge_json(path: str, extra: Mapping[str, Any]) -> None:
    """Add ``extra`` keys to a saved JSON file."""
    if not extra:
        return
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.update(extra)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _make_readable(folder: str) -> None:
    """Open up the folder for other users of a shared cache.

    mkdtemp creates it owner-only and safetensors writes owner-only files; a cache shared
    between users (or containers with different uids) must be world-readable.
    """
    os.chmod(folder, DIR_MODE)
    for entry in os.scandir(folder):
        if entry.is_file():
            os.chmod(entry.path, FILE_MODE)


def build_tokenizer(vocab_size: int, model_max_length: int | None = None) -> Any:
    """A deterministic byte-level BPE tokenizer with exactly ``vocab_size`` tokens.

    Ids 0..2 are the bos/eos/pad specials, then the 256 byte tokens, then merges learned from
    :data:`TOKENIZER_CORPUS`; if the corpus runs out of merges the rest of the vocabulary is
    filled with ``<fillerN>`` tokens that encoding never produces but decoding renders, so
    every id a random model samples decodes to text.

    Args:
        vocab_size: exact number of ids.
        model_max_length: longest sequence the model takes, recorded in the tokenizer.

    Returns:
        A ``transformers`` fast tokenizer ready for ``save_pretrained``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    min_size = len(SPECIAL_TOKENS) + BYTE_ALPHABET_SIZE
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_CORPUS.splitlines(), trainer=trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    filler = 0
    while len(vocab) < vocab_size:
        vocab[FILLER_TOKEN.format(filler)] = len(vocab)
        filler += 1
    tok = Tokenizer.from_str(json.dumps(data))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        **({"model_max_length": model_max_length} if model_max_length else {}),
    )


def _moe_layer_ids(config: Any) -> set[int]:
    """Indices of the layers whose MLP is a routed mixture of experts."""
    layers = range(config.num_hidden_layers)
    if getattr(config, "n_routed_experts", None):  # DeepSeek V2/V3
        first_dense = getattr(config, "first_k_dense_replace", 0) or 0
        freq = getattr(config, "moe_layer_freq", 1) or 1
        return {i for i in layers if i >= first_dense and i % freq == 0}
    if getattr(config, "num_local_experts", None):  # Mixtral
        return set(layers)
    if getattr(config, "num_experts", None):  # Qwen2/Qwen3-MoE
        only_dense = set(getattr(config, "mlp_only_layers", None) or [])
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return {i for i in layers if i not in only_dense and (i + 1) % step == 0}
    return set()


def _attention_params(config: Any) -> int:
    """Matmul weights of one attention block (MLA or grouped-query)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None):  # MLA
        qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        q_rank = getattr(config, "q_lora_rank", None)
        q = hidden * q_rank + q_rank * heads * qk_dim if q_rank else hidden * heads * qk_dim
        kv_a = hidden * (config.kv_lora_rank + config.qk_rope_head_dim)
        kv_b = config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
        return q + kv_a + kv_b + heads * config.v_head_dim * hidden
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def _gated_mlp_params(hidden: int, intermediate: int) -> int:
    """gate, up and down projections of one SwiGLU MLP."""
    return 3 * hidden * intermediate


def _moe_active_params(config: Any) -> int:
    """Matmul weights one token touches in an MoE block: router, its top-k, shared experts."""
    hidden = config.hidden_size
    num_experts = (
        getattr(config, "n_routed_experts", None)
        or getattr(config, "num_local_experts", None)
        or config.num_experts
    )
    expert_size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    active = hidden * num_experts
    active += config.num_experts_per_tok * _gated_mlp_params(hidden, expert_size)
    active += (getattr(config, "n_shared_experts", 0) or 0) * _gated_mlp_params(hidden, expert_size)
    shared_size = getattr(config, "shared_expert_intermediate_size", 0) or 0
    if shared_size:  # Qwen2-MoE: one shared expert with a scalar sigmoid gate
        active += _gated_mlp_params(hidden, shared_size) + hidden
    return active


def flops_per_token(config: Any) -> float:
    """Forward FLOPs per token: 2 x the matmul weights a token is multiplied with.

    Counts attention projections, dense or MoE MLPs (router, the top-k routed experts and any
    shared experts) and the lm_head (also when tied to the embeddings); excludes the embedding
    lookup, norms, biases and the context-dependent attention score/value products.

    Args:
        config: a transformers config object (any attribute-style config works).
    """
    moe_layers = _moe_layer_ids(config)
    dense_mlp = _gated_mlp_params(config.hidden_size, config.intermediate_size)
    params = config.num_hidden_layers * _attention_params(config)
    if moe_layers:
        params += len(moe_layers) * _moe_active_params(config)
    params += (config.num_hidden_layers - len(moe_layers)) * dense_mlp
    params += config.hidden_size * config.vocab_size
    return 2.0 * params


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
