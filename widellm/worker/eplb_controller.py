"""EPLB at run time on one expert-parallel rank: count expert load, re-plan on schedule, move
expert weights one layer per step while serving continues, then switch that layer's maps.

Every rank calls :meth:`EplbController.before_forward` once per forward (real or dummy
batch). Ranks step in lockstep, so their step counters agree, and every collective here
(load all-reduce, weight all-to-all, the "did every rank succeed" all-reduce) happens at the
same step on every rank; they go through an ``EplbCollectives`` (``eplb/collectives.py``:
torch.distributed here, in-process sums and priced moves in the simulator). Schedule, with
``W = window_size`` and ``S = step_interval``:

- every ``W`` steps: all-reduce the window's load, measure balancedness, log it if asked;
- every ``S`` steps: plan a new placement from the window's logical load (planner.py) and,
  if it raises balancedness by at least ``min_balancedness_gain``, queue the layers whose
  placement changes;
- while layers are queued: move one layer per step (its step waits for that move: the
  "stall"), and switch its maps only if every rank moved it; a failure anywhere abandons the
  rest of the plan and leaves the old placement of the unmoved layers in force.

Offline EPLB: with ``load_path``, :meth:`place_from_recorded_load` (called once on every rank
before the first step) plans from the file's load and moves every layer at once; with
``save_path``, every measured window's load is added up (in logical ids) and rank 0
rewrites the file; with ``static``, nothing is re-planned while serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist  # noqa: F401 - the group's type

from widellm.config import EPLBConfig
from widellm.core.outputs import EplbStats
from widellm.eplb.collectives import EplbCollectives, TorchEplbCollectives
from widellm.eplb.executor import plan_layer_moves
from widellm.eplb.load_file import load_expert_load, save_expert_load
from widellm.eplb.planner import balancedness, rank_load, rebalance_experts
from widellm.eplb.stats import ExpertLoadRecorder
from widellm.layers.moe.layer import FusedMoE

logger = logging.getLogger(__name__)

# Measurements kept in EplbStats.history (sent to the frontend with every output batch).
HISTORY_LEN = 32


class EplbController:
    def __init__(self, moe_layers: Sequence[FusedMoE], config: EPLBConfig, rank: int,
                 num_ranks: int, num_nodes: int, group: dist.ProcessGroup | None,
                 collectives: EplbCollectives | None = None) -> None:
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
        # (The placement lives with the weights; a simulator's layers have no weights.)
        self.device = first.placement.phys_to_logical.device
        # The load all-reduce and the weight moves (torch.distributed unless given).
        self.collectives: EplbCollectives = collectives or TorchEplbCollectives(
            self.layers, rank, group, self.device)
        self.recorder = ExpertLoadRecorder(len(self.layers), self.num_physical,
                                           config.window_size, self.device)
        for i, layer in enumerate(self.layers):
            layer.attach_load_recorder(self.recorder, i)
        self.step_count = 0
        self.pending: list[tuple[int, torch.Tensor]] = []  # (layer, new phys_to_logical)
        self.stats = EplbStats()
        # save_path: the logical load of every measured window so far, and the steps covered.
        self.saved_load = torch.zeros(len(self.layers), self.num_logical, dtype=torch.int64)
        self.saved_steps = 0
        # The first forward the recorder's window holds (windows restart after a rebalance).
        self._window_start = 1

    def before_forward(self) -> None:
        self.step_count += 1
        if self.pending:
            self._move_next_layer()
        else:
            measure = self.step_count % self.config.window_size == 0
            plan = (not self.config.static
                    and self.step_count % self.config.step_interval == 0)
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
        return self.collectives.sum_load(self.recorder.window_load())  # a fresh tensor

    def _rank_balancedness(self, physical_load: torch.Tensor) -> float:
        per_rank = physical_load.view(len(self.layers), self.num_ranks, -1).sum(-1)
        return float(balancedness(per_rank.double()).mean())

    def _logical(self, physical: torch.Tensor) -> torch.Tensor:
        """``[layers, P]`` load per slot -> ``[layers, E]`` per logical expert."""
        p2l = torch.stack([m.placement.phys_to_logical.cpu() for m in self.layers])
        logical = torch.zeros(len(self.layers), self.num_logical, dtype=physical.dtype)
        return logical.scatter_add_(1, p2l, physical)

    def _measure(self, physical: torch.Tensor) -> None:
        if self.config.save_path is not None:
            self.saved_load += self._logical(physical).to(torch.int64)
            # The window holds the forwards after the previous measure (or the reset) up to
            # the last one: W of them, fewer for the run's or a new placement's first.
            first = max(self.step_count - self.config.window_size, self._window_start)
            self.saved_steps += self.step_count - first
            if self.rank == 0:  # every rank holds the same sums; one writes them
                save_expert_load(self.config.save_path, self.saved_load,
                                 self.layers[0].top_k, self.saved_steps)
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
        logical = self._logical(physical)
        if int(logical.sum()) == 0:
            return  # nothing routed in the window: nothing to learn from
        new, planned = self._new_placement(logical)
        before = self._rank_balancedness(physical)
        self.stats.last_planned_balancedness = planned
        if planned - before < self.config.min_balancedness_gain:
            if self.config.log_balancedness and self.rank == 0:
                logger.info("EPLB step %d: keeping the placement (balancedness %.3f, a new "
                            "plan would reach %.3f)", self.step_count, before, planned)
            return
        self._queue(new)
        if self.rank == 0:
            logger.info("EPLB step %d: rebalancing %d layers, balancedness %.3f -> %.3f "
                        "(planned on the last window)", self.step_count, len(self.pending),
                        before, planned)

    def _new_placement(self, logical: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The planner's ``[layers, P]`` placement for ``logical`` load, and the balancedness
        it would reach on that load."""
        new, _, count = rebalance_experts(logical, self.num_physical, self.num_groups,
                                          self.num_nodes, self.num_ranks)
        planned = float(balancedness(rank_load(logical, new, count, self.num_ranks)).mean())
        return new, planned

    def _queue(self, new: torch.Tensor) -> None:
        self.pending = [(i, new[i]) for i in range(len(self.layers))
                        if not torch.equal(new[i], self.layers[i].placement.phys_to_logical.cpu())]

    def place_from_recorded_load(self) -> None:
        """With ``load_path``: plan from the recorded load and move every layer now. Called
        once on every rank before the first step (the moves are collectives); a move that
        fails anywhere is an error, since the deployment asked for this placement."""
        path = self.config.load_path
        if path is None:
            return
        logical = load_expert_load(path, len(self.layers), self.num_logical)
        if int(logical.sum()) == 0:
            raise ValueError(f"eplb load_path {path!r} records no load")
        old = torch.stack([m.placement.phys_to_logical.cpu() for m in self.layers])
        old_count = torch.stack([m.placement.logical_replica_count.cpu() for m in self.layers])
        before = float(balancedness(rank_load(logical, old, old_count, self.num_ranks)).mean())
        new, planned = self._new_placement(logical)
        self._queue(new)
        if self.rank == 0:
            logger.info("EPLB: placing experts by %s: balancedness on its load %.3f -> %.3f "
                        "(%d layers move)", path, before, planned, len(self.pending))
        for index, new_p2l in self.pending:
            if not self._move_layer(index, new_p2l):
                raise RuntimeError(f"EPLB: moving MoE layer {index}'s experts to the placement "
                                   f"from {path!r} failed (see the log above)")
        self.pending = []

    # ---- moving --------------------------------------------------------------------------

    def _move_layer(self, index: int, new_p2l: torch.Tensor) -> bool:
        """Move one layer's weights to ``new_p2l``; its maps switch only if every rank moved
        it (see ``eplb/collectives.py`` for the agreements). True if they did."""
        layer = self.layers[index]
        plan = None
        try:
            plan = plan_layer_moves(layer.placement.phys_to_logical.cpu(), new_p2l,
                                    self.num_ranks)
        except Exception:  # noqa: BLE001 - any failure keeps the old placement
            logger.exception("EPLB: planning layer %d failed; keeping its placement", index)
        if not self.collectives.move_layer(index, plan):
            return False
        layer.placement.update_(new_p2l)
        return True

    def _move_next_layer(self) -> None:
        """Move one queued layer while serving; its step waits for it (the stall)."""
        index, new_p2l = self.pending.pop(0)
        start = time.perf_counter()
        if self._move_layer(index, new_p2l):
            if not self.pending:
                self.stats.num_rebalances += 1
                self.recorder.reset()  # measure the new placement from scratch
                self._window_start = self.step_count
        else:
            self.pending.clear()  # the layers not moved yet keep their placement
            self.stats.num_failed_rebalances += 1
        stall = time.perf_counter() - start
        self.stats.max_stall_s = max(self.stats.max_stall_s, stall)
        self.stats.total_stall_s += stall
