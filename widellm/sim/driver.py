"""The simulation's event loop: requests arrive, pools step, outputs come back, in virtual-time
order, one thread.

Events, earliest first (at equal times in this order, so a step sees everything that happened
at its start):

1. a step's outputs, at the step's end: tokens and finishes are stamped; in a disaggregated
   deployment a finished prefill is handed to the decode pool (with the prefill's
   ``kv_transfer_params``, as the proxy forwards them); in closed loop a finish admits the
   next request;
2. a KV transfer ending (``kv_fabric.py``): both ends' schedulers apply it;
3. an arrival (open loop): the request enters the first pool through its load balancer;
4. a pool step, at ``max(the pool's previous step end, now)`` when any of its ranks has
   work. Pools step independently; the ranks of one pool step together.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from widellm.core.outputs import EngineCoreOutput
from widellm.engine.engine_core import EngineCoreRequest
from widellm.sampling_params import SamplingParams
from widellm.sim.clock import VirtualClock
from widellm.sim.config import SimulationConfig
from widellm.sim.kv_fabric import SimKVFabric
from widellm.sim.pool import SimPool
from widellm.sim.types import RequestRecord, StepRecord

# Event priorities at equal times (lower first).
_OUTPUTS, _FABRIC, _ARRIVAL, _STEP = 0, 1, 2, 3
# A prefill pool's request: prompt only, then its KV goes to the decode pool.
PREFILL_MAX_TOKENS = 1


@dataclass
class RequestLife:
    """A request's stamps while it runs (see ``RequestRecord``)."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    pool_rank: int = -1
    num_output_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    def record(self) -> RequestRecord:
        return RequestRecord(self.request_id, self.pool_rank, self.arrival_s,
                             self.num_prompt_tokens, self.num_output_tokens,
                             self.first_token_s, self.finish_s)


class DeploymentRun:
    """Drives a colocated pool, or a prefill and a decode pool, through a workload.

    Args:
        config: the run's limits (``duration_s``, ``max_steps``).
        pools: "colocated", or "prefill" and "decode".
        clock: the deployment's clock.
        workload: requests (``request_id``, ``arrival_s``, ``prompt_token_ids``,
            ``max_tokens``).
        concurrency: closed loop with this many requests in flight (None: open loop).
        fabric: the KV transport of a disaggregated deployment.
    """

    def __init__(self, config: SimulationConfig, pools: dict[str, SimPool], clock: VirtualClock,
                 workload: Sequence[Any], concurrency: int | None,
                 fabric: SimKVFabric | None = None) -> None:
        self.config, self.pools, self.clock, self.fabric = config, pools, clock, fabric
        self.first = pools.get("colocated") or pools["prefill"]
        self.last = pools.get("colocated") or pools["decode"]
        self.concurrency = concurrency
        ordered = (list(workload) if concurrency is not None
                   else sorted(workload, key=lambda r: r.arrival_s or 0.0))
        self.queue = deque(ordered)
        self.lives: dict[str, RequestLife] = {}
        self.steps: list[StepRecord] = []
        self.output_events: list[tuple[float, int]] = []  # see SimResult.output_events
        self.in_flight = 0
        self.free_at = {kind: 0.0 for kind in pools}
        self.now = 0.0
        # (time, priority, sequence, payload): step outputs and hand-offs not yet due.
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        # Disaggregated: prompts of requests still on the prefill pool.
        self._prompts: dict[str, list[int]] = {}
        # Every simulated request ignores EOS and ends at its max_tokens.
        self.params = SamplingParams(temperature=0.0, ignore_eos=True)

    def run(self) -> None:
        cfg = self.config
        while True:
            event = self._next_event()
            if event is None:
                return
            t, kind, payload = event
            if cfg.duration_s is not None and t >= cfg.duration_s:
                return
            self.now = t
            self.clock.set(t)
            if kind == _OUTPUTS:
                heapq.heappop(self._events)
                self._collect(*payload)
            elif kind == _FABRIC:
                self.fabric.deliver()
                for pool in self.pools.values():
                    self._collect(pool, pool.poll())
            elif kind == _ARRIVAL:
                self._admit()
            else:
                if cfg.max_steps is not None and len(self.steps) >= cfg.max_steps:
                    return
                self._step(payload)

    def _next_event(self) -> tuple[float, int, Any] | None:
        candidates = []
        if self._events:
            t, prio, _, payload = self._events[0]
            candidates.append((t, prio, payload))
        if self.fabric is not None and (t := self.fabric.next_event_s()) is not None:
            candidates.append((max(t, self.now), _FABRIC, None))
        if self.queue and self._can_admit():
            arrival = self.now if self.concurrency is not None else (
                self.queue[0].arrival_s or 0.0)
            candidates.append((max(arrival, self.now), _ARRIVAL, None))
        for kind, pool in self.pools.items():
            if pool.has_work():
                candidates.append((max(self.free_at[kind], self.now), _STEP, kind))
        if not candidates:
            return None
        return min(candidates, key=lambda c: (c[0], c[1]))

    def _can_admit(self) -> bool:
        return self.concurrency is None or self.in_flight < self.concurrency

    def _admit(self) -> None:
        """Every request due by now (open loop) or allowed in (closed loop)."""
        while self.queue and self._can_admit():
            if self.concurrency is None and (self.queue[0].arrival_s or 0.0) > self.now:
                return
            req = self.queue.popleft()
            arrival = self.now if self.concurrency is not None else (req.arrival_s or 0.0)
            prompt = list(req.prompt_token_ids)
            life = RequestLife(req.request_id, arrival, len(prompt), req.max_tokens)
            self.lives[req.request_id] = life
            self.in_flight += 1
            disagg = self.first is not self.last
            if disagg:
                self._prompts[req.request_id] = prompt  # for the decode pool's request
            rank = self.first.add_request(EngineCoreRequest(
                request_id=req.request_id, prompt_token_ids=prompt,
                sampling_params=self.params, eos_token_ids=[],
                max_tokens=PREFILL_MAX_TOKENS if disagg else req.max_tokens,
                arrival_time=arrival,
                kv_transfer_params={"do_remote_decode": True} if disagg else None))
            life.pool_rank = rank

    def _step(self, kind: str) -> None:
        pool = self.pools[kind]
        record, outputs = pool.step()
        end = self.clock.now
        self.free_at[kind] = end
        if record is not None:
            self.steps.append(record)
        if outputs:
            self._seq += 1
            heapq.heappush(self._events, (end, _OUTPUTS, self._seq, (pool, outputs)))
        self.clock.set(self.now)

    def _collect(self, pool: SimPool,
                 outputs: list[tuple[int, list[EngineCoreOutput]]]) -> None:
        """A pool's output batches reach the frontend: stamp the requests, tell the pool's
        balancer what finished and each rank's latest stats, hand finished prefills on."""
        now, lives, last, balancer = self.now, self.lives, pool is self.last, pool.balancer
        produced = 0
        for rank, outs in outputs:
            for out in outs:
                life = lives[out.request_id]
                finished = out.finish_reason is not None
                if finished:
                    balancer.request_finished(rank)
                if not last:  # a prefill: on to the decode pool when it finished
                    if finished:
                        self._hand_off(life, out)
                    continue
                if out.new_token_ids:
                    if life.first_token_s is None:
                        life.first_token_s = now
                        life.pool_rank = rank
                    life.num_output_tokens += len(out.new_token_ids)
                    produced += len(out.new_token_ids)
                if finished:
                    life.finish_s = now
                    self.in_flight -= 1
            pool.report_stats(rank)
        if produced:
            self.output_events.append((now, produced))

    def _hand_off(self, life: RequestLife, out: EngineCoreOutput) -> None:
        """What the proxy does with a finished prefill: the same request, with the producer's
        ``kv_transfer_params``, to the decode pool (a failed prefill ends the request)."""
        if out.kv_transfer_params is None:
            life.finish_s = self.now
            self.in_flight -= 1
            self._prompts.pop(life.request_id, None)
            return
        self.last.add_request(EngineCoreRequest(
            request_id=life.request_id, prompt_token_ids=self._prompts.pop(life.request_id),
            sampling_params=self.params, eos_token_ids=[], max_tokens=life.max_tokens,
            arrival_time=life.arrival_s, kv_transfer_params=out.kv_transfer_params))
