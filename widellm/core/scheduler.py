"""Continuous-batching scheduler: one rule for every token.

Each request has ``num_computed_tokens`` and wants ``num_tokens - num_computed_tokens`` more.
A step hands out a token budget (``max_num_batched_tokens``, at most ``max_num_seqs``
requests): running requests first, in admission order, then waiting ones; any prompt that does
not fit is chunked (with ``enable_chunked_prefill`` off it waits for a step it fits). When the
KV pool runs dry, the most recently admitted running request is preempted (blocks freed,
recomputed later from the front of the waiting queue).

With a KV connector (disaggregated prefill/decode, ``widellm.kv_transfer``): a request whose
prompt KV can be loaded from a remote prefill gets its blocks, waits apart
(WAITING_FOR_REMOTE_KVS) while the connector loads them and re-enters the waiting queue with
those tokens computed; a failed load is recomputed or fails the request, as configured. On a
prefill instance, a finished request's blocks are held until the connector reports them sent.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from widellm.config import CacheConfig, SchedulerConfig
from widellm.core.kv_cache_manager import KVCacheManager
from widellm.core.outputs import EngineCoreOutput, ModelRunnerOutput
from widellm.core.request import Request, RequestStatus
from widellm.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from widellm.core.scheduler_stats import SchedulerStats

if TYPE_CHECKING:
    from widellm.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler


class Scheduler:
    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
        kv_connector: "KVConnectorScheduler | None" = None, kv_load_failure_policy: str = "fail",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = scheduler_config
        self.clock = clock  # the engine core's: stamps a request's first admission
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.kv_connector = kv_connector
        self.kv_load_failure_policy = kv_load_failure_policy
        # Consumer: loading their prompt KV. Aborted while loading: their blocks go when the
        # load ends (the connector may still be writing them).
        self.waiting_for_remote: dict[str, Request] = {}
        self.aborted_loading: dict[str, Request] = {}
        # Producer: finished, blocks held for a consumer to pull.
        self.held_for_transfer: dict[str, Request] = {}
        self.num_recomputed = 0

    # ---- lifecycle -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests or rid in self.held_for_transfer or rid in self.aborted_loading:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.kv_connector is not None:
            self.kv_connector.track_remote_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.waiting_for_remote[req_id]
                req.status = RequestStatus.FINISHED_ABORTED
                self.aborted_loading[req_id] = req
                self.finished_req_ids.add(req_id)
                del self.requests[req_id]
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_pending_kv_transfers(self) -> bool:
        """Loads or holds the connector still has to report on (the engine keeps polling)."""
        return bool(self.waiting_for_remote or self.aborted_loading or self.held_for_transfer)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()

        # (request, tokens) in scheduling order; the counters move once both loops are done.
        scheduled: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(self._num_tokens_wanted(req), budget)
            if num_new == 0:
                i += 1  # its in-flight steps already produce every token it may still get
                continue
            new_blocks = self.kv_cache_manager.allocate_slots(req, num_new)
            while new_blocks is None:
                victim = self.running.pop()  # most recently admitted; never one scheduled yet
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(req, num_new)
            if new_blocks is None:
                break
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append([b.block_id for b in new_blocks] if new_blocks else [])
            cached.num_computed_tokens.append(req.num_computed_tokens)
            num_scheduled[req.request_id] = num_new
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1

        # Admitting while preempting would only thrash the pool.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            if req.num_external_tokens:  # loaded from a remote prefill: holds its blocks
                hit_blocks, num_hit = [], req.num_computed_tokens
            else:
                hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(req)
                if self.kv_connector is not None:
                    loading = self._start_remote_load(req, hit_blocks, num_hit)
                    if loading is None:
                        break  # no room for its blocks yet
                    if loading:
                        continue
            if not self.config.enable_chunked_prefill and req.num_tokens - num_hit > budget:
                break  # whole prompts only: it waits for a step with room for all of it
            num_new = min(req.num_tokens - num_hit, budget)
            new_blocks = self.kv_cache_manager.allocate_slots(req, num_new, hit_blocks)
            if new_blocks is None:
                break
            self.waiting.popleft()
            if self.kv_cache_manager.enable_caching and not req.num_external_tokens:
                self.kv_cache_manager.record_prefix_cache_stats(req.num_tokens, num_hit)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.scheduled_ts is None:
                req.scheduled_ts = self.clock()
            self.running.append(req)
            new_reqs.append(NewRequestData(
                req_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=list(req.output_token_ids),
                sampling_params=req.sampling_params,
                eos_token_ids=req.eos_token_ids,
                block_ids=self.kv_cache_manager.get_block_ids(req.request_id),
                num_computed_tokens=num_hit,
                grammar=req.grammar,
            ))
            num_scheduled[req.request_id] = num_new
            scheduled.append((req, num_new))
            budget -= num_new

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
        )
        self.finished_req_ids = set()
        # Tokens scheduled now count as computed: the next schedule() builds on them.
        async_scheduling = self.config.async_scheduling
        for req, n in scheduled:
            req.num_computed_tokens += n
            if async_scheduling and (req.num_computed_tokens
                                     == len(req.all_token_ids) + req.num_output_placeholders):
                req.num_output_placeholders += 1
        if self.kv_connector is not None:
            self.kv_connector.update_state_after_schedule(out, self.requests)
        return out

    def _start_remote_load(self, req: Request, hit_blocks: list, num_hit: int) -> bool | None:
        """Park ``req`` to load the prompt tokens a remote prefill computed, when the
        connector offers some: True if parked, False if it computes them itself, None if the
        pool has no room for their blocks now."""
        num_external, load_async = self.kv_connector.get_num_new_matched_tokens(req, num_hit)
        if num_external == 0:
            return False
        if not load_async:
            raise NotImplementedError("only asynchronous KV loads are supported")
        if self.kv_cache_manager.allocate_slots(req, num_external, hit_blocks,
                                                delay_cache_blocks=True) is None:
            return None
        self.waiting.popleft()
        if self.kv_cache_manager.enable_caching:
            self.kv_cache_manager.record_prefix_cache_stats(req.num_tokens, num_hit)
        req.num_computed_tokens = num_hit
        req.num_cached_tokens = num_hit
        req.num_external_tokens = num_external
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[req.request_id] = req
        self.kv_connector.update_state_after_alloc(
            req, self.kv_cache_manager.get_block_ids(req.request_id), num_external)
        return True

    def update_from_kv_connector(self, out: "KVConnectorOutput") -> list[EngineCoreOutput]:
        """Apply what the connector's worker half finished; returns the outputs of requests
        it failed (policy ``fail``)."""
        for req_id in out.finished_sending:
            if (req := self.held_for_transfer.pop(req_id, None)) is not None:
                self.kv_cache_manager.free(req)
        for req_id in out.finished_recving:
            if (req := self.aborted_loading.pop(req_id, None)) is not None:
                self.kv_cache_manager.free(req)
            elif (req := self.waiting_for_remote.pop(req_id, None)) is not None:
                req.num_computed_tokens += req.num_external_tokens
                self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
                req.kv_transfer_params = None  # consumed: a preemption recomputes locally
                req.status = RequestStatus.WAITING
                self.waiting.appendleft(req)
        outputs = []
        for req_id, cause in out.failed_recving.items():
            if (req := self.aborted_loading.pop(req_id, None)) is not None:
                self.kv_cache_manager.free(req)
            elif (req := self.requests.get(req_id)) is not None and not req.is_finished:
                outputs.extend(self._remote_load_failed(req, cause))
        return outputs

    def _remote_load_failed(self, req: Request, cause: str) -> list[EngineCoreOutput]:
        loading = self.waiting_for_remote.pop(req.request_id, None) is not None
        if loading:
            self.kv_cache_manager.free(req)  # not cached yet: nobody else holds them
        elif req.status != RequestStatus.WAITING:
            return []  # already admitted without the remote KV
        req.num_computed_tokens = 0
        req.num_external_tokens = 0
        req.kv_transfer_params = None
        if self.kv_load_failure_policy == "recompute":
            self.num_recomputed += 1
            if loading:
                req.status = RequestStatus.WAITING
                self.waiting.appendleft(req)
            return []
        if not loading:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ERROR
        req.stop_reason = f"loading the prompt's KV from the prefill instance failed ({cause})"
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]
        return [EngineCoreOutput(request_id=req.request_id, new_token_ids=[],
                                 finish_reason=req.status.finish_reason,
                                 stop_reason=req.stop_reason)]

    def _num_tokens_wanted(self, req: Request) -> int:
        """Tokens to compute next; none when in-flight samples already reach a length limit."""
        pending = req.num_output_placeholders
        num_tokens = len(req.all_token_ids)  # (the properties cost a call per request-step)
        if pending and (len(req.output_token_ids) + pending >= req.max_tokens
                        or num_tokens + pending >= self.max_model_len):
            return 0
        return num_tokens + pending - req.num_computed_tokens

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        requests, running_status = self.requests, RequestStatus.RUNNING  # (hoisted: hot loop)
        index, all_sampled = runner_output.req_id_to_index, runner_output.sampled_token_ids
        grammar_terminated, logprobs = runner_output.grammar_terminated, runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        for req_id in scheduler_output.num_scheduled_tokens:
            req = requests.get(req_id)
            if req is None or req.status != running_status:
                continue  # aborted or preempted while the step ran
            idx = index[req_id]
            new_ids: list[int] = []
            sampled = all_sampled[idx]
            if req.max_tokens == 0 and sampled:  # prompt only: the prompt's end samples nothing
                req.status, sampled = RequestStatus.FINISHED_LENGTH_CAPPED, []
            for token_id in sampled:
                if req.num_output_placeholders:
                    req.num_output_placeholders -= 1
                req.append_output_token(token_id)
                new_ids.append(token_id)
                if self._check_stop(req, req_id in grammar_terminated):
                    break
            prompt_lp = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if not new_ids and prompt_lp is None and not req.is_finished:
                continue
            lp = logprobs[idx] if logprobs else None
            first = len(req.output_token_ids) == len(new_ids)  # none of its tokens went out yet
            kv_params = None
            if req.is_finished:
                self.running.remove(req)
                kv_params = self._free(req)
            outputs.append(EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_ids,
                new_logprobs=lp.as_tuples(len(new_ids)) if lp is not None else None,
                new_prompt_logprobs=prompt_lp.as_tuples() if prompt_lp is not None else None,
                finish_reason=req.status.finish_reason,
                stop_reason=req.stop_reason,
                num_cached_tokens=max(req.num_cached_tokens, 0),
                kv_transfer_params=kv_params,
                queued_ts=req.queued_ts if first else None,
                scheduled_ts=req.scheduled_ts if first else None,
            ))
        return outputs

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )

    # ---- helpers ---------------------------------------------------------------------------

    def _check_stop(self, req: Request, grammar_terminated: bool = False) -> bool:
        """Whether ``req`` ends with its latest token. ``grammar_terminated``: its structured
        output is complete (the grammar accepted a stop token), which ends it even under
        ignore_eos, since the grammar admits nothing after that."""
        params = req.sampling_params
        last = req.output_token_ids[-1]
        num_output = len(req.output_token_ids)
        if grammar_terminated:
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if num_output >= params.min_tokens:
            if not params.ignore_eos and last in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = last
                return True
        if num_output >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # what its in-flight steps sample is discarded
        req.num_external_tokens = 0  # its blocks are gone: it looks the prefix cache up again
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self._free(req)

    def _free(self, req: Request) -> dict | None:
        """Free a finished request's blocks, unless the connector holds them for a remote
        decode; returns the connector's ``kv_transfer_params`` for the client."""
        params, delay = None, False
        if self.kv_connector is not None:
            delay, params = self.kv_connector.request_finished(
                req, self.kv_cache_manager.get_block_ids(req.request_id))
        if delay:
            self.held_for_transfer[req.request_id] = req
        else:
            self.kv_cache_manager.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]
        return params

