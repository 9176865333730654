"""The KV connector API: a scheduler half and a worker half, with vLLM's method names.

Lifecycle of one disaggregated request (prefill instance P = producer, decode instance D =
consumer):

1. P admits it with ``kv_transfer_params={"do_remote_decode": true}``, runs the prompt and
   samples one token. When it finishes, ``request_finished`` (scheduler half) answers "delay
   freeing" and the parameters D needs (where to pull from, which blocks); the blocks stay
   allocated under a lease that the worker half owns: it frees them (``get_finished`` reports
   them in ``finished_sending``) once D pulled them, told P to let go, or the lease ran out
   with no transfer in progress. The scheduler never frees held blocks on its own: a timeout
   on one side can then never free blocks the other side is still reading.
2. D gets the same prompt with those parameters. ``get_num_new_matched_tokens`` says how many
   prompt tokens beyond D's own prefix-cache hit can be loaded; the scheduler allocates blocks
   for them (``update_state_after_alloc``), parks the request as WAITING_FOR_REMOTE_KVS and
   keeps stepping others. ``build_connector_meta`` hands the worker half what to load;
   ``start_load_kv`` starts it in the background; ``get_finished`` reports loaded requests
   (they resume with those tokens computed) and failed ones (with a cause), which follow
   ``kv_load_failure_policy``.

The worker half's per-layer hooks overlap transfers with the forward layer by layer: the TCP
connector's streamed pulls (``streams.py``) use ``begin_forward`` / ``save_kv_layer`` /
``end_forward``; ``wait_for_layer_load`` and ``wait_for_save`` are for a connector that loads
or pushes during the forward, and are no-ops here.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from widellm.core.request import Request
    from widellm.core.scheduler_output import SchedulerOutput
    from widellm.kv_transfer.config import KVTransferConfig
    from widellm.kv_transfer.stats import KVTransferStats


@dataclass(slots=True)
class LoadSpec:
    """Load ``remote_block_ids[i]`` of the producer into ``local_block_ids[i]``; the first of
    them is block ``first_block`` of the request (the ones before were local prefix hits).
    A streamed pull has no remote ids (the producer resolves the blocks) and waits until the
    producer wrote the prompt's first ``num_tokens`` tokens."""

    params: dict[str, Any]
    local_block_ids: list[int]
    remote_block_ids: list[int]
    first_block: int = 0
    num_tokens: int = 0


@dataclass(slots=True)
class StreamSpec:
    """A producer's prompt that a consumer may pull while it runs (it has a ``transfer_id``):
    hold ``new_block_ids`` (the blocks it got this step) from now on."""

    transfer_id: str
    new_block_ids: list[int]
    prompt_sha256: str
    num_prompt_tokens: int


@dataclass(slots=True)
class KVConnectorMetadata:
    """What the scheduler half tells the worker half since the last call.

    Attributes:
        reqs_to_load: consumer: request id -> blocks to fill from its producer.
        reqs_to_hold: producer: request id -> its blocks, now held under a lease.
        reqs_to_track: consumer: request id -> its params, while it waits for blocks (the
            worker half keeps the producer's lease alive with heartbeats meanwhile).
        reqs_to_release: consumer: request id -> params of producers whose blocks are no
            longer wanted (aborted, or all of the prompt was in the local prefix cache).
        reqs_to_stream: producer: request id -> a streamed prompt scheduled this step.
        reqs_to_unstream: producer: streamed prompts aborted or preempted before they
            finished (their blocks are freed: sends of them must stop).
    """

    reqs_to_load: dict[str, LoadSpec] = field(default_factory=dict)
    reqs_to_hold: dict[str, list[int]] = field(default_factory=dict)
    reqs_to_track: dict[str, dict[str, Any]] = field(default_factory=dict)
    reqs_to_release: dict[str, dict[str, Any]] = field(default_factory=dict)
    reqs_to_stream: dict[str, StreamSpec] = field(default_factory=dict)
    reqs_to_unstream: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not (self.reqs_to_load or self.reqs_to_hold or self.reqs_to_track
                    or self.reqs_to_release or self.reqs_to_stream or self.reqs_to_unstream)


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker half finished since the last ``get_finished``.

    Attributes:
        finished_sending: producer: held requests whose blocks may be freed now.
        finished_recving: consumer: requests whose blocks are loaded.
        failed_recving: consumer: request id -> cause (a ``stats.FAILURE_CAUSES`` name).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


class KVConnectorScheduler(abc.ABC):
    """The scheduler's side: decides, never moves bytes."""

    def __init__(self, config: "KVTransferConfig", block_size: int) -> None:
        self.config = config
        self.block_size = block_size

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens after ``num_computed_tokens`` that can be loaded, whether asynchronously)."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """``request`` now holds ``block_ids`` (its whole table); load the external tokens."""

    @abc.abstractmethod
    def track_remote_request(self, request: "Request") -> None:
        """A request with remote KV arrived; keep its producer's lease alive until admitted."""

    def update_state_after_schedule(self, scheduler_output: "SchedulerOutput",
                                    requests: Mapping[str, "Request"]) -> None:
        """A step was scheduled (``requests``: the scheduler's live ones, by id); connectors
        that stream a prompt while it runs note its blocks and fill the output's
        ``kv_stream_tokens``."""

    @abc.abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """Everything decided since the previous call (then forgotten here)."""

    @abc.abstractmethod
    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(whether to delay freeing ``block_ids`` until the worker reports them sent, the
        ``kv_transfer_params`` to return to the client)."""


class KVConnectorWorker(abc.ABC):
    """The model runner's side: owns the transport and reads or writes the KV cache."""

    def __init__(self, config: "KVTransferConfig", block_size: int) -> None:
        self.config = config
        self.block_size = block_size

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: list["torch.Tensor"],
                           block_dims: list[int]) -> None:
        """The KV cache tensors, one per attention layer, and which dim of each is blocks."""

    @abc.abstractmethod
    def transfer_params(self) -> dict[str, Any]:
        """What a consumer needs to reach this worker (engine id, address), for the
        scheduler half to put into a finished request's ``kv_transfer_params``."""

    @abc.abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start what ``metadata`` asks (loads, holds, heartbeats, releases); returns at once."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s part of this step's loads is in the cache."""

    def begin_forward(self, stream_tokens: Mapping[str, int], num_passes: int) -> None:
        """A forward starts (on the forward thread) that brings the streamed prompts in
        ``stream_tokens`` to that many tokens; the attention layers run ``num_passes`` times
        (two micro-batches under dual-batch overlap)."""

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor",
                      attn_metadata: Any) -> None:
        """Start sending ``layer_name``'s KV written by this step (``layer_name``: the
        layer's index among the registered caches)."""

    def end_forward(self) -> None:
        """The forward begun by :meth:`begin_forward` ended."""

    def wait_for_save(self) -> None:
        """Block until this step's sends no longer need the step's buffers."""

    @abc.abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Requests whose transfers ended since the previous call (thread-safe)."""

    @abc.abstractmethod
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks whose load failed since the previous call."""

    @abc.abstractmethod
    def stats(self) -> "KVTransferStats":
        """Counters since start, for the metrics."""

    def wait_for_progress(self, timeout_s: float) -> None:
        """Sleep until some transfer ends or ``timeout_s`` passes (an idle engine's poll)."""

    def shutdown(self) -> None:
        """Stop the transport's threads and close its sockets."""
