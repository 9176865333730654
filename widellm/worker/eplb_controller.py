"""EPLB at run time on one expert-parallel rank: count expert load, re-plan on schedule, move
expert weights one layer per step while serving continues, then switch that layer's maps.

Every rank calls :meth:`EplbController.before_forward` once per forward (real or dummy
batch). Ranks step in lockstep, so their step counters agree, and every collective here
(load all-reduce, weight all-to-all, the "did every rank succeed" all-reduce) happens at the
same step on every rank. Schedule, with ``W = window_size`` and ``S = step_interval``:

- every ``W`` steps: all-reduce the window's load, measure balancedness, log it if asked;
- every ``S`` steps: plan a new placement from the window's logical load (planner.py) and,
  if it raises balancedness by at least ``min_balancedness_gain``, queue the layers whose
  placement changes;
- while layers are queued: move one layer per step (its step waits for that move: the
  "stall"), and switch its maps only if every rank moved it; a failure anywhere abandons the
  rest of the plan and leaves the old placement of the unmoved layers in force.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from widellm.config import EPLBConfig
from widellm.core.outputs import EplbStats
from widellm.eplb.executor import exchange_layer_move, plan_layer_moves, prepare_layer_move
from widellm.eplb.planner import balancedness, rank_load, rebalance_experts
from widellm.eplb.stats import ExpertLoadRecorder
from widellm.layers.moe.layer import FusedMoE

logger = logging.getLogger(__name__)

# Measurements kept in EplbStats.history (sent to the frontend with every output batch).
HISTORY_LEN = 32


class EplbController:
    def __init__(self, moe_layers: Sequence[FusedMoE], config: EPLBConfig, rank: int,
                 num_ranks: int, num_nodes: int, group: dist.ProcessGroup) -> None:
        if not moe_layers or any(m.placement is None for m in moe_layers):
            raise ValueError("EPLB needs MoE layers built with EPLB placement")
        self.layers = list(moe_layers)
        self.config = config
        self.rank, self.num_ranks, self.num_nodes = rank, num_ranks, num_nodes
        self.group = group
        first = self.layers[0]
        self.num_logical = first.num_experts
        self.num_physical = first.placement.phys_to_logical.numel()
        self.num_groups = first.routing.num_expert_group or 1
        self.device = first.w13_weight.device
        self.recorder = ExpertLoadRecorder(len(self.layers), self.num_physical,
                                           config.window_size, self.device)
        for i, layer in enumerate(self.layers):
            layer.attach_load_recorder(self.recorder, i)
        self.step_count = 0
        self.pending: list[tuple[int, torch.Tensor]] = []  # (layer, new phys_to_logical)
        self.stats = EplbStats()

    def before_forward(self) -> None:
        self.step_count += 1
        if self.pending:
            self._move_next_layer()
        else:
            measure = self.step_count % self.config.window_size == 0
            plan = self.step_count % self.config.step_interval == 0
            if measure or plan:
                # One all-reduce serves both when a window and an interval end together.
                physical = self._global_physical_load()
                if measure:
                    self._measure(physical)
                if plan:
                    self._plan(physical)
        self.recorder.step()

    # ---- measuring and planning --------------------------------------------------------

    def _global_physical_load(self) -> torch.Tensor:
        """``[layers, P]`` tokens per physical slot over the window, summed over all ranks."""
        load = self.recorder.window_load()  # a fresh tensor: safe to reduce in place
        dist.all_reduce(load, group=self.group)
        return load.cpu()

    def _rank_balancedness(self, physical_load: torch.Tensor) -> float:
        per_rank = physical_load.view(len(self.layers), self.num_ranks, -1).sum(-1)
        return float(balancedness(per_rank.double()).mean())

    def _measure(self, physical: torch.Tensor) -> None:
        value = self._rank_balancedness(physical)
        s = self.stats
        if s.num_measurements == 0:
            s.initial_balancedness = value
        s.balancedness = value
        s.num_measurements += 1
        s.history = (s.history + [(self.step_count, value, s.num_rebalances)])[-HISTORY_LEN:]
        per_rank = physical.view(len(self.layers), self.num_ranks, -1).sum((0, 2))
        s.rank_load = per_rank.double().tolist()
        if self.config.log_balancedness and self.rank == 0:
            logger.info("EPLB step %d: balancedness %.3f", self.step_count, value)

    def _plan(self, physical: torch.Tensor) -> None:
        old = torch.stack([m.placement.phys_to_logical.cpu() for m in self.layers])
        logical = torch.zeros(len(self.layers), self.num_logical, dtype=physical.dtype)
        logical.scatter_add_(1, old, physical)
        if int(logical.sum()) == 0:
            return  # nothing routed in the window: nothing to learn from
        new, _, count = rebalance_experts(logical, self.num_physical, self.num_groups,
                                          self.num_nodes, self.num_ranks)
        before = self._rank_balancedness(physical)
        planned = float(balancedness(rank_load(logical, new, count, self.num_ranks)).mean())
        self.stats.last_planned_balancedness = planned
        if planned - before < self.config.min_balancedness_gain:
            if self.config.log_balancedness and self.rank == 0:
                logger.info("EPLB step %d: keeping the placement (balancedness %.3f, a new "
                            "plan would reach %.3f)", self.step_count, before, planned)
            return
        self.pending = [(i, new[i]) for i in range(len(self.layers))
                        if not torch.equal(new[i], old[i])]
        if self.rank == 0:
            logger.info("EPLB step %d: rebalancing %d layers, balancedness %.3f -> %.3f "
                        "(planned on the last window)", self.step_count, len(self.pending),
                        before, planned)

    # ---- moving --------------------------------------------------------------------------

    def _move_next_layer(self) -> None:
        """Move one queued layer. Two agreements: after the local preparation (so a rank that
        failed there never leaves its peers waiting inside the all-to-all) and after the
        exchange (so maps switch on every rank or on none)."""
        index, new_p2l = self.pending.pop(0)
        layer = self.layers[index]
        start = time.perf_counter()
        plan = prepared = new_weights = None
        try:
            plan = plan_layer_moves(layer.placement.phys_to_logical.cpu(), new_p2l,
                                    self.num_ranks)
            prepared = prepare_layer_move((layer.w13_weight.data, layer.w2_weight.data), plan,
                                          self.rank)
        except Exception:  # noqa: BLE001 - any failure keeps the old placement
            logger.exception("EPLB: preparing layer %d failed; keeping its placement", index)
        if self._all_agree(prepared is not None):
            try:
                new_weights = exchange_layer_move(prepared, plan, self.rank, self.group)
            except Exception:  # noqa: BLE001
                logger.exception("EPLB: moving layer %d failed; keeping its placement", index)
            if self._all_agree(new_weights is not None):
                layer.w13_weight.data, layer.w2_weight.data = new_weights
                layer.placement.update_(new_p2l)
                if not self.pending:
                    self.stats.num_rebalances += 1
                    self.recorder.reset()  # measure the new placement from scratch
                new_weights = True
        if new_weights is not True:
            self.pending.clear()  # the layers not moved yet keep their placement
            self.stats.num_failed_rebalances += 1
        stall = time.perf_counter() - start
        self.stats.max_stall_s = max(self.stats.max_stall_s, stall)
        self.stats.total_stall_s += stall

    def _all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return int(flag) == 1
