"""Model runner: scheduler output -> flattened inputs -> forward -> logits -> sampled tokens.

It never decides what runs; it applies the scheduler's diffs to its own request states, runs
the batch and reports what it sampled.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
import torch

from widellm.config import EngineConfig
from widellm.core.outputs import LogprobsLists, ModelRunnerOutput
from widellm.core.scheduler_output import SchedulerOutput
from widellm.distributed.ep_context import ExpertParallelContext
from widellm.forward_context import DPMetadata, set_forward_context
from widellm.kv_transfer.base import KVConnectorWorker
from widellm.kv_transfer.kv_layout import block_dim_of
from widellm.kv_transfer.registry import make_worker
from widellm.layers.attention_backend import bind_attention_backend, make_attention_backend
from widellm.layers.attention_metadata import (
    build_attention_metadata, dummy_attention_metadata, metadata_to, pad_attention_metadata,
)
from widellm.layers.linear import warm_packed_linears
from widellm.layers.moe.layer import FusedMoE
from widellm.model.loader import build_model
from widellm.ops.cpu_kernels import load_cpu_kernels
from widellm.step_timer import StepTimer, maybe_phase
from widellm.structured_output.runner_grammars import RunnerGrammars
from widellm.worker.cpu_allocator import keep_freed_memory
from widellm.worker.dbo_runner import DualBatchRunner
from widellm.worker.eplb_controller import EplbController
from widellm.worker.graph_buckets import bucket_for
from widellm.worker.graph_runner import (
    GraphRunner, build_decode_graphs, replayable,
)
from widellm.worker.input_batch import (
    BatchInputs, CachedRequestState, ModelInput, apply_scheduler_output, build_batch_inputs,
)
from widellm.worker.kv_cache import KVCacheSpec, allocate_kv_cache
from widellm.worker.logprobs_lists import compute_prompt_logprobs, to_lists
from widellm.worker.sampler import Sampler, engine_core_seed
from widellm.worker.sampling_metadata import SamplingMetadata
from widellm.worker.sampled_ids import DeviceSampledIds, SampledIdsHandoff
from widellm.worker.ubatch_split import split_dummy_batch, split_model_input

logger = logging.getLogger(__name__)

# Test hook: seconds every model step sleeps before its forward (unset: none).
TEST_STEP_SLEEP_ENV = "WIDELLM_TEST_STEP_SLEEP_S"
# Test hook: "1" makes a CPU engine with capture sizes build the graph runner's eager twin at
# start-up, where a CUDA engine captures its graphs (so multi-process tests run graph steps).
TEST_EAGER_GRAPHS_ENV = "WIDELLM_TEST_EAGER_GRAPHS"
# Test hook: "1" defers the host copy of sampled ids on a CPU engine (see sampled_ids.py).
TEST_DEFER_SAMPLED_IDS_ENV = "WIDELLM_TEST_DEFER_SAMPLED_IDS"
# Rows of the forward a rank without work runs in lockstep: one padding token.
DUMMY_BATCH_ROWS = 1


class ModelRunner:
    def __init__(
        self, config: EngineConfig, ep: ExpertParallelContext | None = None,
        step_timer: StepTimer | None = None,
    ) -> None:
        self.config = config
        mc = config.model_config
        self.block_size = config.cache_config.block_size
        self.vocab_size = mc.hf_config.vocab_size
        self.model = build_model(mc.hf_config, mc.model, mc.dtype, ep, device=config.device)
        # Ranks whose MoE layers exchange tokens with this one (None: this rank alone).
        self.ep_size = ep.size if ep is not None and ep.size > 1 else None
        self.kv_spec = KVCacheSpec.from_model(self.model, self.block_size, mc.dtype)
        rank = config.parallel_config.data_parallel_rank or 0
        # Unseeded random rows draw from this rank's own stream: reproducible for a given
        # --seed, distinct across ranks (see engine_core_seed).
        self.generator = torch.Generator(device=config.device).manual_seed(
            engine_core_seed(mc.seed, rank))
        self.sampler = Sampler(self.generator)
        # Test-only fault injection (WIDELLM_TEST_STEP_SLEEP_S, read once): every step that
        # runs the model first sleeps this long, so tests can hold a step (stall detection).
        self.test_step_sleep_s = float(os.environ.get(TEST_STEP_SLEEP_ENV, "0") or 0)
        self.states: dict[str, CachedRequestState] = {}
        # Seeded generators outlive preemption so a recomputed request keeps its stream.
        self.generators: dict[str, torch.Generator] = {}
        self.grammars = RunnerGrammars(self.vocab_size)  # structured outputs' matchers
        self.graph_sizes = config.scheduler_config.cudagraph_capture_sizes
        self.capture_at_start = bool(self.graph_sizes) and (
            config.on_cuda or os.environ.get(TEST_EAGER_GRAPHS_ENV) == "1")
        # Decode steps replayed as graphs (capture_decode_graphs).
        self.graphs: GraphRunner | None = None
        # Async scheduling on a GPU: sampled ids reach the host behind the next step's launch.
        self.handoff = SampledIdsHandoff(
            (config.on_cuda and config.scheduler_config.async_scheduling)
            or os.environ.get(TEST_DEFER_SAMPLED_IDS_ENV) == "1")
        self.kv_caches: list[torch.Tensor] = []
        # Decode attention reads the paged cache in place where the CPU kernel is available and
        # every attention layer prefers it; otherwise it gathers each context and runs torch
        # attention (the reference path).
        attn = [m for m in self.model.modules() if hasattr(m, "prefers_in_place_decode")]
        backend = self.attention_backend = make_attention_backend(mc.attention_backend)
        bind_attention_backend(self.model, backend)
        self.decode_in_place = backend.in_place_decode or (
            not config.on_cuda
            and all(m.prefers_in_place_decode(self.block_size) for m in attn)
            and load_cpu_kernels() is not None
        )
        self.step_timer = step_timer
        # Padded prompt-step sizes whose kernels are not built yet (see warm_next_size).
        self.sizes_to_warm: list[int] = []
        self.eplb: EplbController | None = None
        # Dual-batch overlap: the micro-batch threads, when the deployment may split steps.
        self.dbo = (DualBatchRunner(self.model)
                    if self.ep_size is not None and config.parallel_config.enable_dbo != "off"
                    else None)
        # Disaggregated prefill/decode: the KV connector's worker half (it owns the transport
        # and reads or writes this rank's KV cache outside the forward).
        kvt = config.kv_transfer_config
        self.kv_connector: KVConnectorWorker | None = (
            make_worker(kvt, self.block_size, rank) if kvt is not None else None)
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        if ep is not None and ep.enable_eplb:
            pc = config.parallel_config
            num_nodes = max(1, pc.data_parallel_size // pc.local_size)
            self.eplb = EplbController(self.moe_layers, config.eplb_config, ep.rank, ep.size,
                                       num_nodes, ep.group)
            self.eplb.place_from_recorded_load()  # offline EPLB: before any step

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.config.device)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(
                self.kv_caches, [block_dim_of(m, self.block_size) for m in self.kv_spec.layers])
            if self.config.kv_transfer_config.is_producer:
                # Each attention layer reports when it ran (its KV is then in the cache), so
                # a streamed prompt's layers go out while the later layers compute.
                for i, layer in enumerate(self.kv_spec.layers):
                    layer.register_forward_hook(self._kv_layer_saved_hook(str(i)))
        if not self.config.on_cuda:
            # Only now: weights and KV cache keep their own (huge-page friendly) mappings;
            # what follows is per-step activations, which should recycle heap memory.
            keep_freed_memory()

    def _kv_layer_saved_hook(self, name: str):
        def hook(module: torch.nn.Module, _args: Any, _output: Any) -> None:
            self.kv_connector.save_kv_layer(name, module.kv_cache, None)
        return hook

    # ---- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, dp_metadata: DPMetadata | None = None,
                      split: bool = False) -> ModelRunnerOutput:
        """Apply ``so`` and run its forward; under expert parallelism ``dp_metadata`` is what
        the ranks agreed for this step (see :meth:`prepare_model_input`) and ``split`` whether
        they agreed to run it as two overlapped micro-batches."""
        return self.run_model_input(self.prepare_model_input(so), dp_metadata, split)

    def prepare_model_input(self, so: SchedulerOutput) -> ModelInput | None:
        """Apply ``so`` to the request states and build its forward inputs (None when nothing
        is scheduled). Split from the forward so that a lockstep rank can vote its row count
        before it runs."""
        apply_scheduler_output(self.states, self.generators, self.grammars, so,
                               self.config.device)
        if so.is_empty:
            return None
        batch = build_batch_inputs(self.states, so.num_scheduled_tokens)
        md = build_attention_metadata(
            batch.query_lens, batch.context_lens, batch.positions, batch.block_table,
            self.block_size, self.decode_in_place,
        )
        input_ids, positions = batch.input_ids, torch.from_numpy(batch.positions)
        num_padded = (self._padded_num_tokens(md.num_tokens) if md.prefills
                      else bucket_for(md.num_tokens, self.graph_sizes) or md.num_tokens)
        if num_padded > md.num_tokens:  # padding rows: token 0 at position 0
            md = pad_attention_metadata(md, num_padded)
            padding = torch.zeros(num_padded - len(input_ids), dtype=torch.int64)
            input_ids, positions = torch.cat([input_ids, padding]), torch.cat([positions, padding])
        # A captured size replays its graph on the step buffers when the ranks' agreement
        # allows (run_model_input); the padded host form above is its eager fallback.
        graph = self.graphs is not None and not md.prefills and num_padded in self.graphs.sizes
        if self.config.on_cuda:  # the eager forward's inputs, on the GPU (no stream wait)
            dev = self.config.device
            md, input_ids, positions = (metadata_to(md, dev),
                                        input_ids.to(dev, non_blocking=True),
                                        positions.to(dev, non_blocking=True))
        input_ids = self.handoff.feed(batch, input_ids, self.states)
        return ModelInput(batch, md, input_ids, positions, so.kv_stream_tokens,
                          num_padded if graph else None)

    @torch.inference_mode()
    def run_model_input(self, inp: ModelInput | None, dp_metadata: DPMetadata | None = None,
                        split: bool = False) -> ModelRunnerOutput:
        if inp is None:
            return ModelRunnerOutput([], {}, [])
        if self.test_step_sleep_s:
            time.sleep(self.test_step_sleep_s)
        timer = self.step_timer
        self._before_forward()
        dp_metadata = self._dp_metadata(inp.num_rows, dp_metadata)
        streams = self.kv_connector is not None and bool(inp.kv_stream_tokens)
        if streams:
            self.kv_connector.begin_forward(inp.kv_stream_tokens, 2 if split else 1)
        try:
            # (A streamed prompt's layers report through forward hooks, which graphs skip.)
            if inp.graph_size is not None and not split and not streams and (
                    dp_metadata is None
                    or replayable(self.moe_layers, dp_metadata.num_tokens_across_dp)):
                with maybe_phase(timer, "graph_replay"):
                    hidden = self._replay(inp)
            elif split:
                ubatches = split_model_input(inp, self.block_size, self.decode_in_place,
                                             dp_metadata)
                with maybe_phase(timer, "forward"):
                    hidden = self._dual_batch().run(ubatches, timer)
            else:
                with maybe_phase(timer, "forward"), set_forward_context(
                        inp.attn_metadata, timer, dp_metadata):
                    hidden = self.model(inp.input_ids, inp.positions)
        finally:
            if streams:
                self.kv_connector.end_forward()
        with maybe_phase(timer, "sample"):
            return self._sample(inp.batch, hidden)

    def _replay(self, inp: ModelInput) -> torch.Tensor:
        slots = inp.attn_metadata.slot_mapping[:len(inp.batch.req_ids)]
        # Deferred ids are on the device only: the buffers take them from there (the host's
        # batch holds placeholders for them).
        md = self.graphs.buffers.load(inp.batch, slots, inp.graph_size, self.handoff.pending)
        return self.graphs.run(md)

    @torch.inference_mode()
    def capture_decode_graphs(self, eager: bool = False) -> None:
        """Capture the decode graphs (after the KV cache is bound: graphs record its
        addresses); ``eager`` (or a CPU engine) builds the reference twin. See
        :func:`build_decode_graphs`."""
        if not self.graph_sizes:
            raise ValueError("decode graphs need capture sizes (--cuda-graph-sizes)")
        # Graph steps decode in place whatever the layers prefer (the shapes must not depend
        # on the contexts): the backend must be able to.
        in_place = self.attention_backend.in_place_decode or load_cpu_kernels() is not None
        self.graphs = build_decode_graphs(
            self.model, self.graph_sizes, self.moe_layers, self.ep_size,
            -(-self.config.model_config.max_model_len // self.block_size), self.block_size,
            self.config.device, in_place, eager)

    def _sample(self, batch: BatchInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        self.handoff.settle()  # the last step's ids: copied long ago, the host reads them now
        pending: list[tuple[int, int]] = []  # (row, index in the deferred ids)
        query_end = np.cumsum(batch.query_lens)
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        terminated: set[str] = set()
        logprobs: list[LogprobsLists | None] = [None] * len(batch.req_ids)
        if batch.sample_rows:
            rows = batch.sample_rows
            last = torch.from_numpy(query_end[rows] - 1).to(hidden.device, non_blocking=True)
            logits = self.model.compute_logits(hidden[last])
            row_ids = [batch.req_ids[r] for r in rows]
            if self.grammars.matchers:
                logits = logits.to(torch.float32)
                with maybe_phase(self.step_timer, "grammar"):
                    self.grammars.mask_logits_(logits, row_ids)
            out = self.sampler(logits, SamplingMetadata.for_requests(
                [self.states[r] for r in row_ids], self.generators, self.vocab_size,
                self.config.device))
            defer = (self.handoff.enabled and not self.grammars.matchers
                     and out.logprobs is None)
            if defer:  # the host learns the ids behind the next step's launch
                self.handoff.defer(DeviceSampledIds(out.sampled_token_ids,
                                                    {r: j for j, r in enumerate(row_ids)}),
                                   self.states, row_ids)
                pending = [(row, j) for j, row in enumerate(rows)]
            else:
                tokens = out.sampled_token_ids.tolist()
                if self.grammars.matchers:
                    with maybe_phase(self.step_timer, "grammar"):
                        terminated = self.grammars.accept(row_ids, tokens)
                for j, row in enumerate(rows):
                    state = self.states[batch.req_ids[row]]
                    state.token_ids.append(tokens[j])
                    sampled[row] = [tokens[j]]
                    n = state.sampling_params.logprobs
                    if out.logprobs is not None and n is not None:
                        logprobs[row] = to_lists(out.logprobs, j, j + 1, n)

        prompt_logprobs = compute_prompt_logprobs(self.model, self.states, batch, hidden,
                                                  query_end)
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar_terminated=terminated,
            pending=self.handoff.pending.host_tokens if pending else None,
            pending_rows=pending,
        )

    @torch.inference_mode()
    def execute_dummy_batch(self, dp_metadata: DPMetadata | None = None,
                            split: bool = False) -> None:
        """``DUMMY_BATCH_ROWS`` padding tokens through the model, touching no request and no KV
        slot: what a rank without work runs so the other ranks' expert-parallel collectives
        complete (as two micro-batches of as many rows when the ranks split the step)."""
        self._before_forward()
        dp_metadata = self._dp_metadata(DUMMY_BATCH_ROWS, dp_metadata)
        # Not timed inside: its MoE communication is idle time, not this rank's own traffic.
        idle = self.step_timer.for_idle() if self.step_timer is not None else None
        if split:
            with maybe_phase(self.step_timer, "dummy"):
                self._dual_batch().run(split_dummy_batch(DUMMY_BATCH_ROWS, dp_metadata), idle)
            return
        zeros = torch.zeros(DUMMY_BATCH_ROWS, dtype=torch.int64, device=self.config.device)
        with maybe_phase(self.step_timer, "dummy"), set_forward_context(
                dummy_attention_metadata(DUMMY_BATCH_ROWS, self.config.device), idle,
                dp_metadata=dp_metadata):
            self.model(zeros, zeros)

    def _dual_batch(self) -> DualBatchRunner:
        if self.dbo is None:
            raise ValueError("a split step needs --enable-dbo (on or auto)")
        return self.dbo

    def shutdown(self) -> None:
        if self.dbo is not None:
            self.dbo.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def _dp_metadata(self, num_rows: int, agreed: DPMetadata | None) -> DPMetadata | None:
        """The step's agreement, checked against this rank's forward; None on one rank."""
        if self.ep_size is None:
            return None
        if agreed is None:
            raise ValueError("an expert-parallel forward needs the ranks' agreed row counts")
        if len(agreed.num_tokens_across_dp) != self.ep_size:
            raise ValueError(f"agreed row counts {agreed.num_tokens_across_dp} are not one per "
                             f"rank of {self.ep_size}")
        return agreed

    @torch.inference_mode()
    def warmup(self, sizes: list[int]) -> None:
        """Run padding-only batches of these token counts through the model and the LM head,
        writing no KV slot (every expert-parallel rank runs the same sizes in the same order,
        so their collectives line up). The first forward at a size pays for oneDNN kernel
        creation and first-touched activation memory: measured 3.3 s for a 4,096-token batch
        of SmolLM2 against 1.9 s warm, which would otherwise land on the first requests."""
        for n in sizes:
            # Every rank warms the same sizes in the same order: the agreement is known.
            same = DPMetadata((n,) * self.ep_size) if self.ep_size is not None else None
            device = self.config.device
            with set_forward_context(dummy_attention_metadata(n, device), dp_metadata=same):
                zeros = torch.zeros(n, dtype=torch.int64, device=device)  # token 0, position 0
                hidden = self.model(zeros, zeros)
            self.model.compute_logits(hidden[: min(n, self.config.scheduler_config.max_num_seqs)])
        # Every padded size a prompt step can have (the multiples below the budget; the budget
        # itself ran above) is left to warm_next_size.
        pad = self.config.scheduler_config.prefill_pad_multiple
        budget = self.config.scheduler_config.max_num_batched_tokens
        self.sizes_to_warm = list(range(pad, budget, pad)) if pad else []
        if self.capture_at_start:
            self.capture_decode_graphs(eager=not self.config.on_cuda)

    @torch.inference_mode()
    def warm_next_size(self) -> None:
        """Warm the next padded prompt-step size (tens of ms): the decoder's packed linears
        only, which are what builds a kernel per row count (the LM head only sees sampled
        rows). The serving loop calls it while idle, so a fresh server's first prompts do not
        pay for it and start-up does not wait for all sizes (~3 s for SmolLM2)."""
        if not self.sizes_to_warm:
            return
        rows = self.sizes_to_warm.pop(0)
        lm_head = getattr(self.model, "lm_head", None)
        warm_packed_linears((m for m in self.model.modules() if m is not lm_head), [rows])
        if not self.sizes_to_warm:
            logger.debug("Warmed the packed linears at every padded prompt-step size")

    def _padded_num_tokens(self, num_tokens: int) -> int:
        """A prompt-carrying step's row count after padding (see prefill_pad_multiple): the
        next multiple, but never past the step budget (expert-parallel buffers are sized for
        it; the budget's own size is warmed at start-up)."""
        sc = self.config.scheduler_config
        pad = sc.prefill_pad_multiple
        if not pad:
            return num_tokens
        return min(-(-num_tokens // pad) * pad, max(num_tokens, sc.max_num_batched_tokens))

    def _before_forward(self) -> None:
        """Per-forward work every EP rank does at the same step (EPLB weight moves)."""
        if self.eplb is not None:
            with maybe_phase(self.step_timer, "eplb"):
                self.eplb.before_forward()
