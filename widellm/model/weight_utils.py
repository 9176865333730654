"""Loading Hugging Face tensors into widellm modules under their checkpoint names.

Three kinds of targets: plain parameters (same name), stacked parameters (``q_proj``/``k_proj``/
``v_proj`` rows of one fused ``qkv_proj``), and routed experts (``...experts.{e}.gate_proj``
handed to the FusedMoE's ``weight_loader``, which keeps only this rank's experts).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from widellm.model.fp8 import SCALE_INV_SUFFIX

# ``...experts.{e}.{proj}.weight``, or its ``weight_scale_inv`` (FP8 experts kept as FP8).
_EXPERT_RE = re.compile(r"^(?P<module>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight"
                        r"(?P<scale>_scale_inv)?$")
_EXPERT_SHARDS = {
    "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",  # DeepSeek, Qwen-MoE
    "w1": "w1", "w3": "w3", "w2": "w2",  # Mixtral
}


# Offset meaning "the second half of the fused rows" (up_proj inside gate_up_proj), which
# holds whatever the intermediate size of the MLP in question.
SECOND_HALF = -1


@dataclass(frozen=True, slots=True)
class StackedShard:
    """Checkpoint weights named ``*.{shard}.*`` fill rows ``[offset, offset + n)`` of
    ``*.{fused}.*``."""

    fused: str
    shard: str
    offset: int


GATE_UP_SHARDS = (
    StackedShard("gate_up_proj", "gate_proj", 0),
    StackedShard("gate_up_proj", "up_proj", SECOND_HALF),
)


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Iterable[StackedShard] = (),
    skip: Iterable[str] = (),
) -> set[str]:
    """Copy ``weights`` into ``model``; returns the parameter names filled. Names matching a
    ``skip`` regex are ignored (e.g. DeepSeek's multi-token-prediction layers)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    stacked = list(stacked)
    skip_re = [re.compile(s) for s in skip]
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(r.search(name) for r in skip_re):
            continue
        m = _EXPERT_RE.match(name)
        if m and m.group("proj") in _EXPERT_SHARDS and m.group("module") in modules:
            shard = _EXPERT_SHARDS[m.group("proj")]
            pname = ("w2_weight" if shard == "w2" else "w13_weight") + (m.group("scale") or "")
            modules[m.group("module")].weight_loader(pname, tensor, int(m.group("expert")), shard)
            loaded.add(f"{m.group('module')}.{pname}")
            continue
        for s in stacked:
            part = f".{s.shard}."
            if part in name:
                pname = name.replace(part, f".{s.fused}.")
                param = params[pname]
                offset = param.shape[0] // 2 if s.offset == SECOND_HALF else s.offset
                if pname.endswith(SCALE_INV_SUFFIX) and s.offset != SECOND_HALF:
                    # An FP8 layer's scale grid: one row per block of weight rows.
                    layer = modules[pname.rsplit(".", 1)[0]]
                    offset //= layer.linear_method.block_size[0]
                param.data[offset:offset + tensor.shape[0]].copy_(tensor)
                loaded.add(pname)
                break
        else:
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in the model")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add(name)
    return loaded


def expert_module_of(name: str) -> str | None:
    """The FusedMoE module a routed-expert checkpoint tensor loads into
    (``"m.layers.3.mlp.experts.7.up_proj.weight"`` -> ``"m.layers.3.mlp.experts"``), else None."""
    m = _EXPERT_RE.match(name)
    return m.group("module") if m is not None and m.group("proj") in _EXPERT_SHARDS else None


def remote_expert_filter(model: nn.Module) -> Callable[[str], bool]:
    """A predicate on checkpoint names: True for routed-expert tensors that belong to another
    expert-parallel rank, so the loader never reads them (each rank reads ~1/EP of them)."""
    modules = dict(model.named_modules())

    def is_remote(name: str) -> bool:
        m = _EXPERT_RE.match(name)
        if m is None or m.group("proj") not in _EXPERT_SHARDS:
            return False
        module = modules.get(m.group("module"))
        is_local = getattr(module, "is_local_expert", None)
        return is_local is not None and not is_local(int(m.group("expert")))

    return is_remote


def check_all_loaded(model: nn.Module, loaded: set[str], tied: Iterable[str] = ()) -> None:
    missing = set(dict(model.named_parameters())) - loaded - set(tied)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")


def process_weights_after_loading(model: nn.Module) -> None:
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None and module is not model:
            hook()
