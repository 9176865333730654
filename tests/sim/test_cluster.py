"""The cluster simulator drives the engine's own scheduler, KV manager, load balancer and
lockstep rule in virtual time: exact step counts and finish times under a linear fake cost
model, closed-loop admission, and checks that no policy of its own stands in for the
engine's."""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import numpy as np
import pytest

from widellm.config import EPLBConfig
from widellm.core.kv_cache_manager import KVCacheManager
from widellm.core.scheduler import Scheduler
from widellm.distributed.load_balancer import DPLoadBalancer
from widellm.engine.dbo_policy import DboPolicy
from widellm.engine.engine_core import EngineCore
from widellm.sim.cluster import simulate
from widellm.sim.config import PoolConfig, SimulationConfig
from widellm.sim.types import RankStepCost

PER_ROW_S = 0.001  # fake cost: seconds per row of the largest rank's forward
FIXED_S = 0.010  # fake cost: seconds per step
PROMPT_LEN = 10
TRANSFER_S = 0.5  # fake P->D KV transfer time
SIM_PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "widellm" / "sim"


class LinearCost:
    """All ranks end together: ``FIXED_S + PER_ROW_S * max rows``; halved rows when split."""

    def __init__(self, split_factor: float = 1.0) -> None:
        self.split_factor = split_factor
        self.calls = []

    def step(self, loads, split):
        self.calls.append((tuple(ld.num_tokens for ld in loads), split))
        t = FIXED_S + PER_ROW_S * max(ld.num_tokens for ld in loads)
        t *= self.split_factor if split else 1.0
        return [RankStepCost(t, {"compute": t}) for _ in loads]


class HotRouting:
    """Every routed copy goes to the ``hot`` first experts, evenly (a skewed router)."""

    def __init__(self, num_experts: int, top_k: int, hot: int) -> None:
        self.num_experts, self.top_k, self.hot = num_experts, top_k, hot

    def counts(self, tokens_per_rank, rng):
        out = np.zeros((len(tokens_per_rank), self.num_experts), dtype=np.int64)
        out[:, : self.hot] = (np.asarray(tokens_per_rank)[:, None] * self.top_k) // self.hot
        return out


@dataclass
class Req:
    request_id: str
    arrival_s: float | None
    prompt_token_ids: list[int]
    max_tokens: int


def _workload(max_tokens: list[int]) -> list[Req]:
    # Distinct prompts shorter than a block: no prefix sharing steers the balancer.
    return [Req(f"r{i}", 0.0, [i + 1] * PROMPT_LEN, m) for i, m in enumerate(max_tokens)]


def _config(model: str, **pool) -> SimulationConfig:
    pool.setdefault("num_ranks", 2)
    pool.setdefault("cuda_graphs", False)
    pool.setdefault("max_num_batched_tokens", 64)
    pool.setdefault("max_num_seqs", 8)
    return SimulationConfig(model=model, colocated=PoolConfig(**pool), max_model_len=256,
                            block_size=16)


def _run(config, cost, workload, routing=None, **kw):
    return simulate(config, lambda hf, shape: cost, workload, routing, **kw)


def test_exact_times_two_ranks_four_requests(model_dir):
    """Balancer: r0, r2 -> rank 0; r1, r3 -> rank 1 (round robin on idle ranks). Steps:
    1 prompts (20, 20 rows), 2 decode (2, 2), 3 (1, 2) after r2 ends, 4 (dummy, 2) after r0
    ends, 5 (dummy, 1) after r3 ends; r1 ends last."""
    cost = LinearCost()
    res = _run(_config(model_dir("DeepseekV3ForCausalLM")), cost, _workload([3, 5, 2, 4]))
    assert [c[0] for c in cost.calls] == [(20, 20), (2, 2), (1, 2), (1, 2), (1, 1)]
    durations = [FIXED_S + PER_ROW_S * r for r in (20, 2, 2, 2, 1)]
    ends = np.cumsum(durations)
    assert [s.duration_s for s in res.steps] == pytest.approx(durations)
    by_id = {r.request_id: r for r in res.requests}
    assert {r: by_id[r].pool_rank for r in by_id} == {"r0": 0, "r1": 1, "r2": 0, "r3": 1}
    assert all(r.first_token_s == pytest.approx(ends[0]) for r in res.requests)
    finish = {r: by_id[r].finish_s for r in by_id}
    assert finish == pytest.approx({"r2": ends[1], "r0": ends[2], "r3": ends[3], "r1": ends[4]})
    assert [by_id[r].num_output_tokens for r in ("r0", "r1", "r2", "r3")] == [3, 5, 2, 4]
    assert res.num_gpus == 2 and res.steps[3].num_tokens == (1, 2)
    # Every step's samples reach the frontend at its end: 4 first tokens, then 4, 3, 2, 1.
    assert [t for t, _ in res.output_events] == pytest.approx(list(ends))
    assert [n for _, n in res.output_events] == [4, 4, 3, 2, 1]


def test_open_loop_waits_for_arrivals(model_dir):
    cost = LinearCost()
    work = [Req("a", 0.0, [1] * PROMPT_LEN, 2), Req("b", 5.0, [2] * PROMPT_LEN, 1)]
    res = _run(_config(model_dir("DeepseekV3ForCausalLM")), cost, work)
    by_id = {r.request_id: r for r in res.requests}
    # b arrives after a finished: the clock jumps to 5 s, b's prompt runs alone.
    assert by_id["b"].arrival_s == 5.0
    assert by_id["b"].finish_s == pytest.approx(5.0 + FIXED_S + PER_ROW_S * PROMPT_LEN)
    assert len(res.steps) == 3


def test_closed_loop_keeps_concurrency(model_dir):
    cost = LinearCost()
    res = _run(_config(model_dir("DeepseekV3ForCausalLM")), cost,
               _workload([2, 2, 2, 2, 2, 2]), concurrency_per_rank=1)
    # Two in flight at a time (one per rank): three waves of (prompt, decode) steps.
    assert all(r.finish_s is not None for r in res.requests)
    assert max(sum(1 for r in res.requests if r.arrival_s <= s.start_s < r.finish_s)
               for s in res.steps) == 2
    assert len(res.steps) == 6


def test_dbo_split_is_the_engine_policys(model_dir):
    """Thresholds: decode 2 rows, prefill 16. Step 1 both PREFILL -> split; 2 (2, 2) both
    DECODE -> split; 3 (1, 2) rank 0 votes NO -> whole; 4 (dummy FOLLOW, 2) -> split;
    5 (dummy, 1) -> whole."""
    cost = LinearCost()
    config = _config(model_dir("DeepseekV3ForCausalLM"), dbo="on",
                     dbo_decode_token_threshold=2, dbo_prefill_token_threshold=16)
    res = _run(config, cost, _workload([3, 5, 2, 4]))
    assert [s.split for s in res.steps] == [True, True, False, True, False]
    assert [c[1] for c in cost.calls] == [True, True, False, True, False]


def test_dbo_auto_learns_from_virtual_time(model_dir):
    """A cost model where split steps take half as long: ``auto`` measures both settings on
    the virtual clock (the engine core's forward timing) and then splits."""
    cost = LinearCost(split_factor=0.5)
    config = _config(model_dir("DeepseekV3ForCausalLM"), dbo="auto",
                     dbo_decode_token_threshold=2, dbo_prefill_token_threshold=16)
    res = _run(config, cost, _workload([40, 40, 40, 40]))
    splits = [s.split for s in res.steps]
    assert splits[:3] == [False, False, True]  # prompt step, then decode: whole, split
    assert sum(splits[-10:]) >= 9  # then splits, but for a rare re-probe


def test_eplb_rebalances_a_skewed_run(model_dir):
    """All routed copies go to experts 0-3, which the initial contiguous split puts on rank 0
    (balancedness 0.5); the engine's controller measures, plans with the real planner, moves
    the single simulated layer, and later steps are balanced."""
    cost = LinearCost()
    eplb = EPLBConfig(enable_eplb=True, num_redundant_experts=2, window_size=4,
                      step_interval=8, min_balancedness_gain=0.05)
    config = _config(model_dir("DeepseekV3ForCausalLM"), eplb=eplb)
    res = _run(config, cost, _workload([30, 30, 30, 30]), HotRouting(16, 4, 4))
    before = [s.balancedness for s in res.steps[:8]]
    after = [s.balancedness for s in res.steps[10:]]
    assert max(before) == pytest.approx(0.5)
    assert min(after) > 0.9
    summary = res.config["eplb_summary"]["colocated"]
    assert summary["num_rebalances"] == 1 and summary["moved_bytes"] > 0


class TransferCost(LinearCost):
    """LinearCost, and every P->D KV transfer takes ``TRANSFER_S``."""

    def kv_transfer_s(self, num_tokens):
        return TRANSFER_S


def test_disaggregated_prefill_then_decode(model_dir, monkeypatch):
    """Prefill pool (1 rank): both prompts in one step (20 rows), each finishes with
    max_tokens=1 and its blocks held. Decode pool (2 ranks): the hand-offs park in
    WAITING_FOR_REMOTE_KVS (one empty step: dummies); the prefill rank's one link moves r0's
    KV in TRANSFER_S, then r1's in TRANSFER_S more; each request's last prompt token and
    decodes run once its KV is in (r0's three steps end before r1's load does); the
    prefill's held blocks are freed."""
    import widellm.sim.cluster as cluster

    pools = []
    real_pool = cluster.SimPool
    monkeypatch.setattr(cluster, "SimPool",
                        lambda *a, **k: pools.append(real_pool(*a, **k)) or pools[-1])
    model = model_dir("DeepseekV3ForCausalLM")
    small = dict(cuda_graphs=False, max_num_batched_tokens=64, max_num_seqs=8)
    config = SimulationConfig(model=model, prefill=PoolConfig(num_ranks=1, **small),
                              decode=PoolConfig(num_ranks=2, **small), max_model_len=256,
                              block_size=16)
    cost = TransferCost()
    res = _run(config, cost, _workload([3, 2]))
    prefill_end = FIXED_S + PER_ROW_S * 2 * PROMPT_LEN
    park_end = prefill_end + FIXED_S + PER_ROW_S
    r0_loaded, r1_loaded = prefill_end + TRANSFER_S, prefill_end + 2 * TRANSFER_S
    step = FIXED_S + PER_ROW_S
    assert [s.pool for s in res.steps] == ["prefill"] + ["decode"] * 6
    assert [s.start_s for s in res.steps] == pytest.approx(
        [0.0, prefill_end, r0_loaded, r0_loaded + step, r0_loaded + 2 * step,
         r1_loaded, r1_loaded + step])
    assert park_end < r0_loaded and r0_loaded + 3 * step < r1_loaded
    by_id = {r.request_id: r for r in res.requests}
    assert by_id["r0"].first_token_s == pytest.approx(r0_loaded + step)
    assert by_id["r0"].finish_s == pytest.approx(r0_loaded + 3 * step)
    assert by_id["r1"].first_token_s == pytest.approx(r1_loaded + step)
    assert by_id["r1"].finish_s == pytest.approx(r1_loaded + 2 * step)
    assert [by_id[r].num_output_tokens for r in ("r0", "r1")] == [3, 2]
    # Output tokens are the decode pool's (the prefill's sample stays inside the proxy).
    assert [t for t, _ in res.output_events] == pytest.approx(
        [r0_loaded + step, r0_loaded + 2 * step, r0_loaded + 3 * step, r1_loaded + step,
         r1_loaded + 2 * step])
    assert [n for _, n in res.output_events] == [1] * 5
    assert {r.pool_rank for r in res.requests} == {0, 1}  # decode ranks
    prefill = pools[0]
    assert prefill.kind == "prefill"
    assert not prefill.cores[0].scheduler.held_for_transfer


def test_the_simulator_runs_the_engines_classes(model_dir, monkeypatch):
    import widellm.sim.cluster as cluster

    pools = []
    real_pool = cluster.SimPool

    def keep(*args, **kwargs):
        pools.append(real_pool(*args, **kwargs))
        return pools[-1]

    monkeypatch.setattr(cluster, "SimPool", keep)
    _run(_config(model_dir("DeepseekV3ForCausalLM"), dbo="on"), LinearCost(), _workload([2]))
    pool = pools[0]
    assert type(pool.balancer) is DPLoadBalancer
    for core in pool.cores:
        assert type(core) is EngineCore and type(core.scheduler) is Scheduler
        assert type(core.scheduler.kv_cache_manager) is KVCacheManager
        assert type(core.dbo_policy) is DboPolicy


def test_the_sim_package_defines_no_policy_of_its_own():
    """No class in widellm/sim may be a scheduler, balancer, planner, KV manager or DBO
    policy: those must be the engine's."""
    banned = ("Scheduler", "Balancer", "Planner", "KVCacheManager", "BlockPool", "Policy",
              "Lockstep")
    for path in SIM_PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert not node.name.endswith(banned), f"{path.name}: class {node.name}"
