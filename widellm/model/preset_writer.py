"""Writing a preset's checkpoint folder: the transformers model built from its spec under a
private seed, DeepSeek-V3's score-correction bias made nonzero (and skewed for ``-skewed``
presets), the FP8 rewrite for FP8 presets, the tokenizer, and permissions for a shared cache.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from widellm.model.preset_spec import PresetSpec
from widellm.model.preset_tokenizer import TOKENIZER_CONFIG_OVERRIDES, build_tokenizer

# HF initialises the DeepSeek-V3 score-correction bias to zeros, which would leave the
# bias-for-selection path untested; this scale is comparable to the spread of sigmoid router
# scores of a randomly initialised router, so the bias really changes some selections.
SCORE_BIAS_STD = 0.02
# Offset the bias generator's seed from the weight seed so the two streams are independent.
SCORE_BIAS_SEED_OFFSET = 1

# Router skew (PresetSpec.router_skew), for presets whose expert load must be unbalanced so that
# expert-parallel load balancing has something to fix. A random router spreads tokens fairly
# evenly (contiguous EP2/EP4 balancedness of the unskewed DeepSeek-V3 presets: ~0.55-0.98,
# uneven only through their small random bias and correlated hidden states); the skew adds to
# the DeepSeek-V3 score-correction bias (selection only, gate values stay the model's own)
# ``router_skew * unit * heat[e]``, where ``unit`` is the spread of the sigmoid
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
DIR_MODE = 0o755
FILE_MODE = 0o644


def skew_profile() -> list[float]:
    """The skew recipe's constants, for the preset hash: editing them must not serve stale
    weights."""
    return [SKEW_WARM, SKEW_BLOCK, SKEW_HOT, SKEW_HOT_SPAN_DIV, SKEW_WARM_SPAN_DIV,
            SKEW_SEED_OFFSET]


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
    randomize_score_bias(model, spec.seed)
    if spec.router_skew:
        skew_router(model, config, spec.router_skew, spec.seed)
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


def randomize_score_bias(model: Any, seed: int) -> None:
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


def skew_router(model: Any, config: Any, skew: float, seed: int) -> None:
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
