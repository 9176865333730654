"""EPLB's collectives behind one small interface, so that the controller's schedule, recorder
and planner run unchanged in the engine (torch.distributed over the EP group) and in the
simulator (in-process sums, weight moves priced instead of made; ``widellm/sim/eplb.py``).

Two operations, each called at the same step on every rank of the EP group:

- ``sum_load``: this rank's window load -> the load summed over the EP group;
- ``move_layer``: move one MoE layer's expert weights to a new placement and say whether
  every rank succeeded (the caller switches the layer's routing maps only then).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from widellm.eplb.executor import LayerMovePlan, exchange_layer_move, prepare_layer_move

logger = logging.getLogger(__name__)


class EplbCollectives(Protocol):
    def sum_load(self, load: torch.Tensor) -> torch.Tensor:
        """``[layers, P]`` int64 selections per physical slot of this rank -> the same summed
        over the EP group, on the CPU. ``load`` is a fresh tensor the callee may reuse."""
        ...

    def move_layer(self, index: int, plan: LayerMovePlan | None) -> bool:
        """Move MoE layer ``index``'s weights as ``plan`` says (None: this rank could not
        plan the move; it still takes part, voting no). True only if every rank moved it."""
        ...


class TorchEplbCollectives:
    """The engine's: all-reduce over the EP device group, weights moved by one all-to-all per
    layer, with two agreements (after the local preparation, so a rank that failed there
    never leaves its peers waiting inside the all-to-all, and after the exchange, so maps
    switch on every rank or on none).

    Args:
        layers: the rank's MoE layers (``expert_parameters()``: ``[S, ...]`` each).
        rank: this rank in the EP group.
        group: the EP device group.
        device: where the layers' weights and the agreement flags live.
    """

    def __init__(self, layers: Sequence[Any], rank: int, group: dist.ProcessGroup | None,
                 device: torch.device) -> None:
        self.layers, self.rank, self.group, self.device = list(layers), rank, group, device

    def sum_load(self, load: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(load, group=self.group)
        return load.cpu()

    def move_layer(self, index: int, plan: LayerMovePlan | None) -> bool:
        params = self.layers[index].expert_parameters()
        prepared = new_weights = None
        if plan is not None:
            try:
                prepared = prepare_layer_move([p.data for p in params], plan, self.rank)
            except Exception:  # noqa: BLE001 - any failure keeps the old placement
                logger.exception("EPLB: preparing layer %d failed; keeping its placement",
                                 index)
        if not self._all_agree(prepared is not None):
            return False
        try:
            new_weights = exchange_layer_move(prepared, plan, self.rank, self.group)
        except Exception:  # noqa: BLE001
            logger.exception("EPLB: moving layer %d failed; keeping its placement", index)
        if not self._all_agree(new_weights is not None):
            return False
        for param, new in zip(params, new_weights):
            # In place: a captured CUDA graph reads the weights at their addresses.
            param.data.copy_(new)
        return True

    def _all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return int(flag) == 1
