"""The cluster simulator's entry point: a deployment of simulated pools driven in virtual time,
one process, one thread.

``simulate`` resolves the model (widellm's own loader, no weights), builds each pool's engine
cores over one virtual clock (``pool.py``), a cost model per pool, and, for disaggregated
prefill/decode, the simulated KV transport between the pools (``kv_fabric.py``); the event
loop (``driver.py``) runs the workload through them. Requests enter through the pool's
``DPLoadBalancer`` (the frontend's) at their arrival time (open loop) or whenever a request
finishes, to keep ``concurrency_per_rank x ranks`` in flight (closed loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from widellm.gc_heap import sparse_young_collections
from widellm.model.loader import load_hf_config, resolve_model_path
from widellm.sim.clock import VirtualClock
from widellm.sim.config import PoolConfig, SimulationConfig
from widellm.sim.driver import DeploymentRun
from widellm.sim.kv_fabric import SimKVFabric
from widellm.sim.pool import SimPool
from widellm.sim.runner import SimKVSpec
from widellm.sim.types import CostModel, DeploymentShape, SimResult

# Container allocations between young-generation collections while simulating (Python's
# default: 700); see ``gc_heap.sparse_young_collections``.
SIM_GC_GEN0_THRESHOLD = 1_000_000

# (hf_config, the pool's shape) -> the pool's cost model.
CostModelFactory = Callable[[Any, DeploymentShape], CostModel]


def deployment_shape(pool: PoolConfig) -> DeploymentShape:
    """The cost model's view of a pool."""
    return DeploymentShape(
        num_ranks=pool.num_ranks, ranks_per_node=pool.ranks_per_node,
        expert_parallel=pool.num_ranks > 1, all2all_backend=pool.all2all_backend,
        cuda_graphs=pool.cuda_graphs,
        num_redundant_experts=pool.eplb.num_redundant_experts if pool.eplb.enable_eplb else 0,
        max_num_seqs=pool.max_num_seqs)


def default_cost_model_factory(config: SimulationConfig) -> CostModelFactory:
    """The cost model of ``config.hardware`` and ``config.weight_dtype`` (``sim/cost_model.py``)."""
    from widellm.sim.cost_model import make_cost_model
    from widellm.sim.hardware import load_profile

    from widellm.sim.cost_model import kv_transfer_time

    profile = load_profile(config.hardware)

    def build(hf_config: Any, shape: DeploymentShape) -> CostModel:
        model = make_cost_model(hf_config, profile, shape, config.weight_dtype)
        if not hasattr(model, "kv_transfer_s"):  # P->D transfers between nodes
            model.kv_transfer_s = lambda num_tokens: kv_transfer_time(
                num_tokens, hf_config, profile, inter_node=True)
        return model

    return build


def simulate(config: SimulationConfig, cost_model_factory: CostModelFactory,
             workload: Sequence[Any], routing: Any, *,
             concurrency_per_rank: int | None = None) -> SimResult:
    """Simulate ``workload`` on ``config``'s deployment.

    Args:
        config: the deployment and the run's limits.
        cost_model_factory: ``(hf_config, DeploymentShape) -> CostModel``, called once per
            pool (``default_cost_model_factory(config)`` for the hardware profile's). A cost
            model may also offer ``weight_move_s(bytes)`` (EPLB moves) and
            ``kv_transfer_s(num_tokens)`` (P->D transfers); else the config's bandwidths
            price them.
        workload: requests with ``request_id``, ``arrival_s`` (seconds; None/0 in closed
            loop), ``prompt_token_ids`` and ``max_tokens`` (``sim/workload.py``'s SimRequest).
        routing: ``counts(tokens_per_rank [R] int, rng) -> [R, E]`` routed copies per source
            rank and logical expert (``sim/routing.py``'s ExpertRouting); None: no MoE
            traffic is modelled.
        concurrency_per_rank: closed loop with this many requests in flight per rank of the
            last pool (the colocated or the decode pool); arrival times are ignored. None:
            open loop by arrival time.

    Returns:
        Every request's life and every step, in virtual seconds; ``sim_wall_s`` is the
        simulator's own run time.
    """
    wall_start = time.perf_counter()
    model_path = resolve_model_path(config.model)
    hf_config = load_hf_config(model_path)
    clock = VirtualClock()
    rng = np.random.default_rng(config.seed)
    shapes = {kind: deployment_shape(p) for kind, p in config.pools().items()}
    costs = {kind: cost_model_factory(hf_config, shape) for kind, shape in shapes.items()}
    fabric = None
    if config.disaggregated:
        fabric = SimKVFabric(clock, _kv_transfer_pricer(config, hf_config, costs["decode"]))
    pools = {kind: SimPool(kind, config, p, model_path, hf_config, clock, costs[kind], routing,
                           rng, fabric)
             for kind, p in config.pools().items()}
    last = config.colocated or config.decode
    concurrency = (concurrency_per_rank * last.num_ranks
                   if concurrency_per_rank is not None else None)
    run = DeploymentRun(config, pools, clock, workload, concurrency, fabric)
    try:
        with sparse_young_collections(SIM_GC_GEN0_THRESHOLD):
            run.run()
    finally:
        for pool in pools.values():
            for core in pool.cores:
                core.shutdown()
    result = SimResult(requests=[life.record() for life in run.lives.values()],
                       steps=run.steps, num_gpus=config.num_gpus, config=config.to_dict(),
                       sim_wall_s=time.perf_counter() - wall_start,
                       output_events=run.output_events)
    result.config["eplb_summary"] = {kind: _eplb_summary(pool) for kind, pool in pools.items()}
    return result


def _kv_transfer_pricer(config: SimulationConfig, hf_config: Any,
                        cost_model: CostModel) -> Callable[[int], float]:
    """Seconds to move ``num_tokens`` tokens of KV from a prefill to a decode rank."""
    priced = getattr(cost_model, "kv_transfer_s", None)
    if priced is not None:
        return priced
    per_token = SimKVSpec.from_hf_config(hf_config, config.block_size,
                                         config.kv_dtype_bytes).bytes_per_token
    return lambda num_tokens: num_tokens * per_token / config.kv_transfer_bytes_per_s


def _eplb_summary(pool: SimPool) -> dict | None:
    """The EPLB controller's counters, for reports (None without EPLB)."""
    if pool.eplb is None:
        return None
    s = pool.eplb.controller.stats
    return {"num_rebalances": s.num_rebalances, "initial_balancedness": s.initial_balancedness,
            "balancedness": s.balancedness, "moved_bytes": pool.eplb.collectives.moved_bytes,
            "history": list(s.history)}
