"""One simulated pool: the engine's own ``EngineCore`` per rank (its ``Scheduler`` and
``KVCacheManager``), the frontend's ``DPLoadBalancer`` in front of them, the lockstep rule
(``lockstep.decide``), each rank's ``DboPolicy``, and the engine's EPLB controller
(``sim/eplb.py``), stepped in virtual time.

A step does what a lockstep rank's loop does (``engine/core_proc.py: _run_lockstep``), for all
ranks at once: every rank plans (schedules and prepares) its step and votes; the votes combine
by the one rule the engine uses; every rank takes its DBO decision from the agreement; then,
in place of the forward, the ranks' loads are priced by the cost model in one call (the step
ends for all when the slowest rank's collectives end), the clock moves to that end, and each
rank hands its samples to its scheduler.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import numpy as np

from widellm.config import (
    CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, resolve_dtype,
)
from widellm.core.outputs import EngineCoreOutput
from widellm.distributed.groups import DPGroups
from widellm.distributed.load_balancer import DPLoadBalancer
from widellm.distributed.lockstep import decide
from widellm.engine.engine_core import EngineCore, EngineCoreRequest
from widellm.engine.kv_budget import blocks_needed
from widellm.engine.kv_budget import logger as kv_budget_logger
from widellm.kv_transfer.config import KVTransferConfig
from widellm.sim.clock import VirtualClock
from widellm.sim.config import PoolConfig, SimulationConfig
from widellm.sim.eplb import SimEplb
from widellm.sim.experts import ExpertStep, ExpertTraffic
from widellm.sim.kv_fabric import SIM_CONNECTOR_NAME, SimKVFabric
from widellm.sim.runner import SimModelInput, sim_runner_factory
from widellm.sim.types import CostModel, RankStepLoad, StepRecord
from widellm.worker.graph_buckets import default_capture_sizes
from widellm.worker.model_runner import DUMMY_BATCH_ROWS

# The dtype the engine config names (the simulated runner allocates nothing in it).
SIM_MODEL_DTYPE = "bfloat16"
# A disaggregated pool's KV connector role.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def pool_engine_config(sim: SimulationConfig, pool: PoolConfig, model_path: str,
                       hf_config: Any, rank: int,
                       kv_transfer: KVTransferConfig | None = None) -> EngineConfig:
    """The ``EngineConfig`` rank ``rank`` of ``pool`` would be started with (``kv_transfer``:
    its connector in a disaggregated deployment)."""
    sched = SchedulerConfig(
        max_num_batched_tokens=pool.max_num_batched_tokens, max_num_seqs=pool.max_num_seqs,
        max_model_len=sim.max_model_len,
        cudagraph_capture_sizes=(default_capture_sizes(pool.max_num_seqs)
                                 if pool.cuda_graphs else ()))
    cache = CacheConfig(block_size=sim.block_size, num_kv_blocks=pool.num_kv_blocks,
                        kv_cache_memory=pool.kv_cache_memory,
                        enable_prefix_caching=pool.enable_prefix_caching)
    parallel = ParallelConfig(
        data_parallel_size=pool.num_ranks, data_parallel_rank=rank,
        enable_expert_parallel=pool.num_ranks > 1, all2all_backend=pool.all2all_backend,
        enable_dbo=pool.dbo, dbo_decode_token_threshold=pool.dbo_decode_token_threshold,
        dbo_prefill_token_threshold=pool.dbo_prefill_token_threshold)
    config = EngineConfig(
        model_config=ModelConfig(model_path, sim.model, hf_config, resolve_dtype(SIM_MODEL_DTYPE),
                                 sim.max_model_len, model_path, sim.seed),
        cache_config=cache, scheduler_config=sched, parallel_config=parallel,
        eplb_config=pool.eplb, kv_transfer_config=kv_transfer)
    if cache.num_kv_blocks is None and cache.kv_cache_memory is None:
        # The engine's by-need size, without the host-memory cap (no host is simulated).
        cache = CacheConfig(block_size=sim.block_size, num_kv_blocks=blocks_needed(config),
                            enable_prefix_caching=pool.enable_prefix_caching)
        config = config.replace(cache_config=cache)
    return config


class SimPool:
    """The ranks of one pool and the policies in front of them.

    Args:
        kind: "colocated", "prefill" or "decode" (recorded in the steps).
        sim: the simulation (model length, block size, dtypes, seed).
        pool: this pool's shape and flags.
        model_path, hf_config: the resolved model.
        clock: the deployment's virtual clock.
        cost_model: prices this pool's steps.
        routing: the routing model, ``counts(tokens_per_rank [R], rng) -> [R, E]``.
        rng: numpy generator for the routing draws.
        fabric: the simulated KV transport of a disaggregated deployment (None: colocated);
            the pool's ranks are then producers ("prefill") or consumers ("decode").
    """

    def __init__(self, kind: str, sim: SimulationConfig, pool: PoolConfig, model_path: str,
                 hf_config: Any, clock: VirtualClock, cost_model: CostModel, routing: Any,
                 rng: np.random.Generator, fabric: SimKVFabric | None = None) -> None:
        self.kind, self.pool, self.clock = kind, pool, clock
        self.cost_model, self.routing, self.rng = cost_model, routing, rng
        n = pool.num_ranks
        kvt = worker = None
        if fabric is not None:
            kvt = KVTransferConfig(SIM_CONNECTOR_NAME, KV_ROLES[kind])
            worker = (lambda config: fabric.worker(
                kvt, sim.block_size, f"{kind}-{config.parallel_config.data_parallel_rank}"))
        factory = sim_runner_factory(clock, sim.kv_dtype_bytes, worker)
        self.cores = []
        for r in range(n):
            # Every rank sizes the same cache: its log line once per pool, not once per rank.
            with _quiet(kv_budget_logger) if r else contextlib.nullcontext():
                self.cores.append(EngineCore(
                    pool_engine_config(sim, pool, model_path, hf_config, r, kvt),
                    DPGroups(r, n, None, None) if n > 1 else None,
                    runner_factory=factory, clock=clock))
        self.runners = [c.model_runner for c in self.cores]
        num_blocks = min(r.num_blocks for r in self.runners)
        # The frontend tracks as many prefix blocks per rank as the smallest pool holds.
        self.balancer = DPLoadBalancer(n, sim.block_size, max_tracked_blocks=num_blocks)
        num_experts = getattr(hf_config, "n_routed_experts", None) or 0
        num_physical = num_experts + (pool.eplb.num_redundant_experts
                                      if pool.eplb.enable_eplb else 0)
        if n > 1 and num_physical % n:  # the engine's rule (ExpertParallelContext.expert_map)
            raise ValueError(f"{num_experts} routed experts + redundant slots = {num_physical} "
                             f"do not split evenly over {n} EP ranks")
        self.traffic = ExpertTraffic(n, pool.ranks_per_node) if num_experts and routing else None
        self.eplb = None
        if pool.eplb.enable_eplb:
            move_s = getattr(cost_model, "weight_move_s", None) or (
                lambda nbytes: nbytes / sim.eplb_move_bytes_per_s)
            self.eplb = SimEplb(pool.eplb, hf_config, n, pool.num_nodes, sim.weight_dtype,
                                move_s)
        # Without EPLB: one slot per expert, the contiguous split (expert e on slot e).
        self._identity = (np.arange(num_experts), np.ones(num_experts))
        self.num_steps = 0
        self.num_dbo_steps = 0

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> int:
        """Route ``request`` as the frontend does and queue it on that rank; returns it."""
        rank = self.balancer.choose_rank(request.prompt_token_ids, request.cache_salt)
        self.cores[rank].add_request(request)
        return rank

    def has_work(self) -> bool:
        return any(c.has_unfinished_requests() for c in self.cores)

    def poll(self) -> list[tuple[int, list[EngineCoreOutput]]]:
        """What the engine loop does before scheduling: apply finished KV transfers (loaded
        requests rejoin the waiting queue, sent blocks are freed); returns the outputs of
        failed loads. Only ranks with a connector have anything to poll."""
        outputs = []
        for rank, core in enumerate(self.cores):
            if core.kv_worker is not None:
                outs = core.poll_pending()
                if outs:
                    outputs.append((rank, outs))
        return outputs

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> tuple[StepRecord | None, list[tuple[int, list[EngineCoreOutput]]]]:
        """One lockstep step of every rank; returns its record (None: no rank had work)
        and each working rank's outputs."""
        cores, start = self.cores, self.clock.now
        polled = self.poll()
        steps = [c.plan_step() for c in cores]
        agreement = decide([c.make_vote(s, False) for c, s in zip(cores, steps)])
        agreements = [c.adopt_agreement(agreement) for c in cores]
        if not agreement.any_has_work:
            return None, polled
        split = agreements[0].split
        stall = self.eplb.before_forward() if self.eplb is not None else 0.0
        inputs: list[SimModelInput | None] = [s.model_input for s in steps]
        expert = self._expert_step(inputs)
        if self.eplb is not None and expert is not None:
            self.eplb.record(expert.slot_tokens)
        loads = self._loads(inputs, expert)
        costs = self.cost_model.step(loads, split)
        duration = max(c.total_s for c in costs) + stall
        end = start + duration
        outputs = polled
        for rank, (core, step, ag) in enumerate(zip(cores, steps, agreements)):
            self.clock.set(start)  # each rank's part of the step starts at the step's start
            self.runners[rank].forward_end_s = end
            outs = core.run_planned_step(step, ag)
            if step.has_work:
                outputs.append((rank, outs))
        self.clock.set(end)
        self.num_steps += 1
        self.num_dbo_steps += split
        record = StepRecord(
            pool=self.kind, start_s=start, duration_s=duration, split=split,
            num_tokens=tuple(ld.num_tokens for ld in loads), costs=tuple(costs),
            balancedness=expert.balancedness if expert is not None else 1.0)
        return record, outputs

    def _expert_step(self, inputs: list[SimModelInput | None]) -> ExpertStep | None:
        if self.traffic is None:
            return None
        tokens = np.fromiter((i.num_tokens if i is not None else 0 for i in inputs),
                             np.int64, len(inputs))
        counts = np.asarray(self.routing.counts(tokens, self.rng), dtype=np.float64)
        p2l, replicas = self.eplb.placement() if self.eplb is not None else self._identity
        return self.traffic.step(counts, p2l, replicas)

    @staticmethod
    def _loads(inputs: list[SimModelInput | None],
               expert: ExpertStep | None) -> list[RankStepLoad]:
        n = len(inputs)
        if expert is not None:
            recv, top = expert.recv_tokens.tolist(), expert.max_expert_tokens.tolist()
            active, intra = expert.active_slots.tolist(), expert.sent_intra_node.tolist()
            inter = expert.sent_inter_node.tolist()
        else:
            recv = top = intra = inter = [0.0] * n
            active = [0] * n
        loads = []
        for r, inp in enumerate(inputs):
            if inp is None:
                loads.append(RankStepLoad(
                    num_tokens=DUMMY_BATCH_ROWS, expert_recv_tokens=recv[r],
                    max_expert_tokens=top[r], active_local_experts=active[r], is_dummy=True))
                continue
            loads.append(RankStepLoad(
                num_tokens=inp.num_rows, num_prefill_tokens=inp.num_prefill_tokens,
                num_decode_tokens=inp.num_decode_tokens, num_seqs=inp.num_seqs,
                attn_kv_read_tokens=inp.attn_kv_read_tokens,
                attn_score_pairs=inp.attn_score_pairs, expert_recv_tokens=recv[r],
                max_expert_tokens=top[r], active_local_experts=active[r],
                sent_intra_node=intra[r], sent_inter_node=inter[r]))
        return loads

    def report_stats(self, rank: int) -> None:
        """What the frontend does after each output batch of ``rank`` (its finished requests
        already reported with ``balancer.request_finished``): its scheduler stats replace
        the balancer's estimate."""
        sched = self.cores[rank].scheduler
        self.balancer.update_stats(rank, len(sched.waiting), len(sched.running))


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """``logger`` says only warnings and errors inside the block."""
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
