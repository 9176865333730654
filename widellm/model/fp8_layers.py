"""Which linear layers of a model keep a DeepSeek FP8 checkpoint's weights as FP8.

A layer keeps them when every checkpoint weight that fills it is FP8 and, for a layer stacked
from several checkpoint weights (``gate_up_proj`` from ``gate_proj`` and ``up_proj``), every
shard starts on a block boundary, so that the shards' scale grids stack into the layer's grid
(DeepSeek-V3's intermediate sizes, 18,432 and 2,048, are multiples of 128; a tiny test model's
64 is not, and its stacked layer is dequantized instead). Routed experts are no ``Linear``:
:func:`fp8_expert_layer_names` picks the ``FusedMoE`` layers that keep theirs by the same rule
(up's rows on a block boundary; ``layers/moe/experts_fp8.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from widellm.layers.linear import Linear
from widellm.layers.linear_method import PlainLinearMethod
from widellm.layers.moe.experts_fp8 import fp8_experts_supported
from widellm.layers.moe.layer import FusedMoE
from widellm.model.fp8 import SCALE_INV_SUFFIX
from widellm.model.weight_utils import SECOND_HALF, StackedShard, expert_module_of

WEIGHT_SUFFIX = ".weight"


def layer_of(weight_name: str, stacked: Iterable[StackedShard]) -> tuple[str, StackedShard | None]:
    """The layer a checkpoint weight fills, by the loader's own renaming (weight_utils):
    ``"m.mlp.up_proj.weight"`` -> ``("m.mlp.gate_up_proj", up's shard)``, an unstacked
    ``"X.weight"`` -> ``("X", None)``."""
    for s in stacked:
        part = f".{s.shard}."
        if part in weight_name:
            return weight_name.replace(part, f".{s.fused}.")[: -len(WEIGHT_SUFFIX)], s
    return weight_name[: -len(WEIGHT_SUFFIX)], None


def fp8_layer_names(model: nn.Module, checkpoint_names: Iterable[str],
                    block_size: tuple[int, int]) -> set[str]:
    """The names of ``model``'s plain ``Linear`` layers that can hold the checkpoint's FP8
    weights as they are.

    Args:
        model: the built, not yet loaded model (its ``stacked_shards`` say which checkpoint
            weights fill one layer).
        checkpoint_names: every tensor name of the checkpoint (FP8 weights are the ``X.weight``
            that have an ``X.weight_scale_inv``).
        block_size: (rows, columns) per scale.

    Example: a checkpoint with ``mlp.gate_proj.weight`` and ``mlp.up_proj.weight`` (both with
    scales) filling a 256-row ``mlp.gate_up_proj`` gives ``{"mlp.gate_up_proj"}`` with 128-row
    blocks (up starts at row 128); with a 128-row gate_up_proj (up at row 64) it gives ``set()``.
    """
    names = set(checkpoint_names)
    stacked = tuple(getattr(model, "stacked_shards", ()))
    modules = dict(model.named_modules())
    verdict: dict[str, bool] = {}
    for name in names:
        if not name.endswith(WEIGHT_SUFFIX):
            continue
        layer_name, shard = layer_of(name, stacked)
        layer = modules.get(layer_name)
        if not isinstance(layer, Linear) or type(layer.linear_method) is not PlainLinearMethod:
            continue
        ok = name + SCALE_INV_SUFFIX in names
        if shard is not None:
            offset = layer.out_features // 2 if shard.offset == SECOND_HALF else shard.offset
            ok = ok and offset % block_size[0] == 0
        verdict[layer_name] = verdict.get(layer_name, True) and ok
    return {name for name, ok in verdict.items() if ok}


def fp8_expert_layer_names(model: nn.Module, checkpoint_names: Iterable[str],
                           block_size: tuple[int, int]) -> set[str]:
    """The names of ``model``'s ``FusedMoE`` layers that can hold the checkpoint's FP8 expert
    weights as they are: every expert weight of the layer has its scale, and the layer's
    shape allows it (:func:`fp8_experts_supported`)."""
    names = set(checkpoint_names)
    modules = dict(model.named_modules())
    verdict: dict[str, bool] = {}
    for name in names:
        module_name = expert_module_of(name) if name.endswith(WEIGHT_SUFFIX) else None
        layer = modules.get(module_name) if module_name is not None else None
        if not isinstance(layer, FusedMoE):
            continue
        ok = name + SCALE_INV_SUFFIX in names and fp8_experts_supported(layer, block_size)
        verdict[module_name] = verdict.get(module_name, True) and ok
    return {name for name, ok in verdict.items() if ok}
