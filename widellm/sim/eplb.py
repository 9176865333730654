"""EPLB in the simulator: the engine's own ``EplbController`` (schedule, recorder, planner,
move queue), given weightless MoE layers and collectives that need no process group.

The engine has one controller per rank, each recording its own tokens and all-reducing the
window's load; every rank then plans the same placement from the same sum. The simulator keeps
one controller per pool and records every rank's tokens into it, so its window already holds
the EP-wide sum (``sum_load`` is the identity) and its plan is the one every rank would make.

One simulated MoE layer stands for all of the model's MoE layers (the routing model draws one
distribution per step, so every layer would get the same load and the same plan); its move
is charged as the moves of all the layers it stands for, in the step that makes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from widellm.config import EPLBConfig
from widellm.eplb.executor import LayerMovePlan
from widellm.eplb.placement import ExpertPlacement
from widellm.eplb.stats import ExpertLoadRecorder
from widellm.worker.eplb_controller import EplbController

# Weight matrices of one routed expert: gate and up (w13) and down (w2).
EXPERT_MATRICES = 3
WEIGHT_DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True, slots=True)
class _Routing:
    num_expert_group: int | None


class SimMoELayer:
    """What ``EplbController`` reads of an MoE layer: its experts, placement and grouping."""

    def __init__(self, num_experts: int, num_physical: int, num_ranks: int,
                 num_expert_group: int | None) -> None:
        self.num_experts = num_experts
        self.placement = ExpertPlacement.initial(num_experts, num_physical, num_ranks)
        self.routing = _Routing(num_expert_group)
        self.recorder: ExpertLoadRecorder | None = None
        self.index = 0

    def attach_load_recorder(self, recorder: ExpertLoadRecorder, moe_layer_index: int) -> None:
        self.recorder, self.index = recorder, moe_layer_index


class SimEplbCollectives:
    """``EplbCollectives`` in one process: the load is already summed; a weight move always
    succeeds and costs ``move_seconds(bytes)`` for the busiest rank's received bytes, which
    the pool adds to the step that makes the move (``take_stall_s``).

    Args:
        bytes_per_expert: one routed expert's weights.
        layers_per_move: model layers one simulated layer stands for.
        move_seconds: prices the busiest rank's received bytes.
    """

    def __init__(self, bytes_per_expert: int, layers_per_move: int,
                 move_seconds: Callable[[int], float]) -> None:
        self.bytes_per_expert = bytes_per_expert
        self.layers_per_move = layers_per_move
        self.move_seconds = move_seconds
        self._stall_s = 0.0
        self.moved_bytes = 0

    def sum_load(self, load: torch.Tensor) -> torch.Tensor:
        return load.cpu()

    def move_layer(self, index: int, plan: LayerMovePlan | None) -> bool:
        if plan is None:
            return False
        most = max((len(r) for r in plan.recvs), default=0)
        nbytes = most * self.bytes_per_expert * self.layers_per_move
        self.moved_bytes += plan.num_remote * self.bytes_per_expert * self.layers_per_move
        self._stall_s += self.move_seconds(nbytes)
        return True

    def take_stall_s(self) -> float:
        """Seconds of weight moves since the last call (the step that made them waits)."""
        stall, self._stall_s = self._stall_s, 0.0
        return stall


class SimEplb:
    """A pool's EPLB: the engine's controller over one simulated layer.

    Args:
        config: the pool's EPLB flags.
        hf_config: the model (experts, grouping, expert sizes, MoE layer count).
        num_ranks, num_nodes: the pool's shape.
        weight_dtype: ``fp8``/``bf16``/..., sizes a moved expert.
        move_seconds: prices a move's bytes (busiest rank).
    """

    def __init__(self, config: EPLBConfig, hf_config: Any, num_ranks: int, num_nodes: int,
                 weight_dtype: str, move_seconds: Callable[[int], float]) -> None:
        num_experts = hf_config.n_routed_experts
        num_physical = num_experts + config.num_redundant_experts
        self.layer = SimMoELayer(num_experts, num_physical, num_ranks,
                                 getattr(hf_config, "n_group", None))
        expert_bytes = (EXPERT_MATRICES * hf_config.hidden_size * hf_config.moe_intermediate_size
                        * WEIGHT_DTYPE_BYTES.get(weight_dtype, 2))
        self.collectives = SimEplbCollectives(expert_bytes, count_moe_layers(hf_config),
                                              move_seconds)
        self.controller = EplbController([self.layer], config, 0, num_ranks, num_nodes, None,
                                         collectives=self.collectives)

    def placement(self) -> tuple[np.ndarray, np.ndarray]:
        """``(phys_to_logical [P], replica_count [E])`` in force now."""
        p = self.layer.placement
        return p.phys_to_logical.numpy(), p.logical_replica_count.numpy()

    def before_forward(self) -> float:
        """The controller's per-step work (measure, plan, move one layer); returns the
        seconds of weight moves this step waits for."""
        self.controller.before_forward()
        return self.collectives.take_stall_s()

    def record(self, slot_tokens: np.ndarray) -> None:
        """This step's tokens per physical slot, all ranks summed (after ``before_forward``,
        as the forward records after the controller's step)."""
        self.controller.recorder.record_counts(
            0, torch.from_numpy(np.rint(slot_tokens).astype(np.int64)))


def count_moe_layers(hf_config: Any) -> int:
    """MoE layers of a DeepSeek-style model (dense ones first, then every ``moe_layer_freq``)."""
    first = getattr(hf_config, "first_k_dense_replace", 0) or 0
    freq = getattr(hf_config, "moe_layer_freq", 1) or 1
    return max(1, sum(1 for i in range(first, hf_config.num_hidden_layers) if i % freq == 0))
