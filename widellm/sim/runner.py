"""The simulated model runner: the engine core's runner contract without a model.

It keeps the same per-request state the real runner keeps (applied from the scheduler's
diffs: new requests, gained blocks, finished and preempted ids), pads a step's rows the way
the real runner does (decode steps to a CUDA-graph size), and "samples" one token for every
request whose known tokens its step reaches, exactly where the real runner would. It never
samples an end-of-sequence token: simulated requests end by ``max_tokens``.

Instead of a forward it describes one: :class:`SimModelInput` carries the row counts and the
attention work of the step, which the pool turns into a ``RankStepLoad`` once the routing
model has said where the tokens' experts are (``widellm/sim/experts.py``). The forward itself
only moves the virtual clock to the end of the step the cost model priced
(``forward_end_s``, set by the pool before each rank runs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from widellm.config import EngineConfig
from widellm.core.outputs import ModelRunnerOutput
from widellm.core.scheduler_output import SchedulerOutput
from widellm.forward_context import DPMetadata
from widellm.sim.clock import VirtualClock
from widellm.worker.graph_buckets import bucket_for

# The token every simulated sample returns (no stop token is configured for simulated
# requests, so any id works; 0 keeps outputs readable).
SIM_TOKEN_ID = 0


@dataclass(frozen=True, slots=True)
class SimKVSpec:
    """What the engine core reads of the runner's KV spec: bytes per KV block of one rank.

    ``bytes_per_token_per_layer``: MLA models store the compressed latent plus the rope key
    (``kv_lora_rank + qk_rope_head_dim`` elements), others K and V per KV head.
    """

    num_layers: int
    block_size: int
    elements_per_token_per_layer: int
    dtype_bytes: int

    @classmethod
    def from_hf_config(cls, hf_config: Any, block_size: int, dtype_bytes: int) -> "SimKVSpec":
        if getattr(hf_config, "kv_lora_rank", None):
            elems = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
        else:
            heads = hf_config.num_attention_heads
            kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
            head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
            elems = 2 * kv_heads * head_dim
        return cls(hf_config.num_hidden_layers, block_size, elems, dtype_bytes)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.elements_per_token_per_layer * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


@dataclass(frozen=True, slots=True)
class SimAttnMetadata:
    """The one field of the attention metadata the engine's policies read (``DboPolicy``):
    whether the step carries prompt tokens."""

    prefills: bool


@dataclass(slots=True)
class SimModelInput:
    """One rank's prepared step, as counts.

    Attributes:
        num_rows: rows of the forward, padding included (the rank's vote).
        num_tokens: real (scheduled) tokens, the ones routed to experts.
        num_prefill_tokens, num_decode_tokens, num_seqs: the batch's make-up.
        attn_kv_read_tokens, attn_score_pairs: attention work (see ``RankStepLoad``).
        req_ids: the scheduled requests, in the scheduler's order.
        sample_ids: the requests that sample a token this step.
    """

    num_rows: int
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    attn_kv_read_tokens: int
    attn_score_pairs: int
    req_ids: list[str]
    sample_ids: list[str]
    attn_metadata: SimAttnMetadata = field(default_factory=lambda: SimAttnMetadata(False))
    kv_stream_tokens: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _SimRequestState:
    num_prompt_tokens: int
    num_known_tokens: int  # prompt + outputs the runner has sampled or was told of
    num_computed_tokens: int


class SimulatedRunner:
    """A rank's runner in the simulator; build it with :func:`sim_runner_factory`.

    Args:
        config: the rank's engine configuration (model shape, block size, graph sizes).
        clock: the deployment's virtual clock.
        kv_spec: bytes per block of this model's KV cache.
    """

    def __init__(self, config: EngineConfig, clock: VirtualClock, kv_spec: SimKVSpec,
                 kv_connector: Any = None) -> None:
        self.config = config
        self.clock = clock
        self.kv_spec = kv_spec
        self.graph_sizes = config.scheduler_config.cudagraph_capture_sizes
        self.states: dict[str, _SimRequestState] = {}
        # Disaggregated pools: the simulated connector worker (``sim/kv_fabric.py``).
        self.kv_connector = kv_connector
        self.sizes_to_warm: list[int] = []
        self.num_blocks = 0
        # Where the current step ends in virtual time; the pool sets it before the forward.
        self.forward_end_s = 0.0

    # ---- the engine core's start-up calls ------------------------------------------------

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks  # the scheduler's KV manager owns the blocks

    def warmup(self, sizes: list[int]) -> None:
        """Nothing to warm: no kernels."""

    def warm_next_size(self) -> None:
        """Nothing to warm: no kernels."""

    def shutdown(self) -> None:
        """Nothing to release."""

    # ---- one step ------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput, dp_metadata: DPMetadata | None = None,
                      split: bool = False) -> ModelRunnerOutput:
        return self.run_model_input(self.prepare_model_input(so), dp_metadata, split)

    def prepare_model_input(self, so: SchedulerOutput) -> SimModelInput | None:
        """Apply ``so`` to the request states and count its step (None: nothing scheduled)."""
        self._update_states(so)
        if so.is_empty:
            return None
        states = self.states
        prefill = decode = kv_read = pairs = 0
        sample_ids = []
        for req_id, n in so.num_scheduled_tokens.items():
            st = states[req_id]
            start = st.num_computed_tokens
            end = start + n
            st.num_computed_tokens = end
            if n == 1 and start >= st.num_prompt_tokens:
                decode += 1
                kv_read += end
                pairs += end
            else:  # a prompt chunk (or a preempted request's recompute)
                prefill += n
                kv_read += start
                pairs += n * start + n * (n + 1) // 2
            if end == st.num_known_tokens:
                sample_ids.append(req_id)
        total = so.total_num_scheduled_tokens
        rows = total if prefill else (bucket_for(total, self.graph_sizes) or total)
        return SimModelInput(
            num_rows=rows, num_tokens=total, num_prefill_tokens=prefill,
            num_decode_tokens=decode, num_seqs=len(so.num_scheduled_tokens),
            attn_kv_read_tokens=kv_read, attn_score_pairs=pairs,
            req_ids=list(so.num_scheduled_tokens), sample_ids=sample_ids,
            attn_metadata=SimAttnMetadata(prefill > 0), kv_stream_tokens=so.kv_stream_tokens)

    def run_model_input(self, inp: SimModelInput | None, dp_metadata: DPMetadata | None = None,
                        split: bool = False) -> ModelRunnerOutput:
        """The step's samples; the forward's time passes on the clock (to ``forward_end_s``)."""
        if inp is None:
            return ModelRunnerOutput([], {}, [])
        self.clock.set(self.forward_end_s)
        sampled: dict[str, list[int]] = {}
        for req_id in inp.sample_ids:
            self.states[req_id].num_known_tokens += 1
            sampled[req_id] = [SIM_TOKEN_ID]
        req_ids = inp.req_ids
        no_sample: list[int] = []
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, no_sample) for r in req_ids],
        )

    def execute_dummy_batch(self, dp_metadata: DPMetadata | None = None,
                            split: bool = False) -> None:
        """A rank without work takes part in the step: its time passes too."""
        self.clock.set(self.forward_end_s)

    def _update_states(self, so: SchedulerOutput) -> None:
        states = self.states
        for req_id in so.finished_req_ids:
            states.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            prompt = len(new.prompt_token_ids)
            states[new.req_id] = _SimRequestState(
                prompt, prompt + len(new.output_token_ids), new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            states[req_id].num_computed_tokens = num_computed


def sim_runner_factory(clock: VirtualClock, kv_dtype_bytes: int,
                       kv_worker: Callable[[EngineConfig], Any] | None = None):
    """A ``runner_factory`` for ``EngineCore``: ``(config, ep, step_timer) -> SimulatedRunner``
    over the deployment's clock, with the KV spec of ``config``'s model and, in a
    disaggregated pool, the connector worker ``kv_worker(config)`` builds."""

    def build(config: EngineConfig, _ep: Any, _step_timer: Any) -> SimulatedRunner:
        spec = SimKVSpec.from_hf_config(config.model_config.hf_config,
                                        config.cache_config.block_size, kv_dtype_bytes)
        return SimulatedRunner(config, clock, spec,
                               kv_worker(config) if kv_worker is not None else None)

    return build


def kv_bytes(spec: SimKVSpec, num_tokens: int) -> int:
    """Bytes of ``num_tokens`` tokens of KV (whole blocks, as a transfer moves them)."""
    return math.ceil(num_tokens / spec.block_size) * spec.bytes_per_block
