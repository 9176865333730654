"""``EPLBConfig``: the expert-parallel load balancing settings (``--enable-eplb`` and
``--eplb-config``), part of the engine config (``widellm.config`` re-exports it)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EPLBConfig:
    """Expert-parallel load balancing: measure expert load over a window of steps, re-plan
    replicas and placement every ``step_interval`` steps, move weights while serving.

    Offline EPLB (vLLM's ``save_path`` / ``load_path`` / ``static``, SGLang's
    ``--init-expert-location``): ``save_path`` keeps the load measured in this run in a file;
    ``load_path`` places the experts by such a file before the first step, so that the
    first steps (a run's prompts) start balanced instead of waiting a window for data;
    ``static`` keeps that placement (measuring continues, re-planning does not).
    """

    enable_eplb: bool = False
    # Physical expert slots beyond the logical experts, for replicas of hot experts.
    num_redundant_experts: int = 0
    window_size: int = 1000  # steps of load kept
    step_interval: int = 3000  # steps between rebalances
    log_balancedness: bool = False
    # A plan is applied only if it raises balancedness by at least this much: moving a layer
    # stalls a step, and chasing the noise of a good placement costs more than it saves
    # (measured: re-moving every layer every 16 steps to go from 0.98 to 0.998 cost ~7 s of a
    # 50 s run; docs/BENCHMARKS.md). 0 applies every plan that is not worse.
    min_balancedness_gain: float = 0.05
    # A recorded expert load (eplb/load_file.py) to place the experts by at start-up.
    load_path: str | None = None
    # Where to keep the load of every measured window of this run (rewritten at each window).
    save_path: str | None = None
    # Never re-plan while serving (the placement from load_path, or the initial one, stays).
    static: bool = False

    def __post_init__(self) -> None:
        if self.num_redundant_experts < 0:
            raise ValueError(
                f"eplb_num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.window_size < 1:
            raise ValueError(f"eplb_window_size must be >= 1, got {self.window_size}")
        if self.step_interval < 1:
            raise ValueError(f"eplb_step_interval must be >= 1, got {self.step_interval}")
        if not 0.0 <= self.min_balancedness_gain <= 1.0:
            raise ValueError(f"eplb_min_balancedness_gain must be in [0, 1], got "
                             f"{self.min_balancedness_gain}")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError("eplb_num_redundant_experts needs --enable-eplb")
        if (self.load_path or self.save_path or self.static) and not self.enable_eplb:
            raise ValueError("eplb load_path, save_path and static need --enable-eplb")
        # Checked here so that a wrong path fails before the model loads, not after.
        if self.load_path is not None and not os.path.isfile(self.load_path):
            raise ValueError(f"eplb load_path {self.load_path!r} is not a file")
        if self.save_path is not None:
            parent = os.path.dirname(os.path.abspath(self.save_path))
            if not os.path.isdir(parent):
                raise ValueError(f"eplb save_path {self.save_path!r}: directory {parent!r} "
                                 "does not exist")
