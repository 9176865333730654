"""The producer's streamed prompts: KV sent layer by layer while the prompt still runs.

With the proxy's streamed flow the decode instance gets the request at the same time as the
prefill instance, with a ``transfer_id`` both share, and pulls at once (``pull_stream``). The
side channel then sends layer L of the prompt's blocks as soon as the forward has written
layer L for every token asked for, so layer L travels while layers L+1.. compute, and the
decode instance has the whole prompt a layer's transfer after the prefill ends, not a whole
transfer after.

Progress is marked on the thread that runs the forwards: ``begin_forward`` with the prompt
tokens each streamed request will have once this forward ran, ``save_layer`` after each
attention layer (once per micro-batch of a dual-batch-overlap step, hence ``num_passes``), and
``end_forward``, which marks every layer (a layer whose hook did not run must not stall a
pull). Side-channel threads wait on it with :meth:`wait_stream` and :meth:`wait_layer`.

Example: a 40-token prompt, 2 layers, chunks of 32 and 8 tokens. After the first forward
both layers have 32 tokens; a pull of 39 tokens waits. During the second forward
``save_layer(0)`` makes layer 0 hold 40: its frame goes out while layer 1 computes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from widellm.kv_transfer.stats import TransferError

# Early releases remembered (a consumer that had the prompt cached lets go at once); a
# forgotten one costs only a lease of held blocks.
MAX_EARLY_RELEASES = 4096


@dataclass(slots=True)
class Stream:
    """One streamed prompt on the producer.

    Attributes:
        request_id: the producer's id of the request.
        prompt_sha256: its prompt's identity (the consumer's must match).
        num_prompt_tokens: its prompt's length.
        layer_tokens: per attention layer, the prompt tokens whose KV is in the cache.
        broken: the request was aborted or preempted: its blocks may be reused any moment.
    """

    request_id: str
    prompt_sha256: str
    num_prompt_tokens: int
    layer_tokens: list[int]
    broken: bool = False


class StreamTable:
    """Thread-safe table of streamed prompts, by ``transfer_id`` and by request id."""

    def __init__(self, num_layers: int = 0) -> None:
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._by_transfer: dict[str, Stream] = {}
        self._transfer_of: dict[str, str] = {}  # request id -> transfer id
        # The forward in progress: request id -> its prompt tokens once it ran.
        self._forward: dict[str, int] = {}
        self._passes = 1
        self._saves: list[int] = []
        # Transfers a consumer let go of before their prompt was scheduled here (it had the
        # prompt cached itself), oldest first: their holds end as soon as they finish.
        self._released_early: dict[str, None] = {}

    # ---- the engine loop (scheduling decisions) ------------------------------------------

    def register(self, request_id: str, transfer_id: str, prompt_sha256: str,
                 num_prompt_tokens: int) -> None:
        with self._cond:
            if transfer_id in self._by_transfer and not self._by_transfer[transfer_id].broken:
                return  # a later chunk of the same prompt
            self._by_transfer[transfer_id] = Stream(request_id, prompt_sha256,
                                                    num_prompt_tokens, [0] * self.num_layers)
            self._transfer_of[request_id] = transfer_id
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        """The request was aborted or preempted: sends of it stop before reading further."""
        with self._cond:
            if (tid := self._transfer_of.get(request_id)) is not None:
                self._by_transfer[tid].broken = True
                self._cond.notify_all()

    def forget(self, request_ids: set[str]) -> None:
        """The holds of these requests ended: nobody pulls them any more."""
        with self._cond:
            for rid in request_ids:
                if (tid := self._transfer_of.pop(rid, None)) is not None:
                    self._by_transfer.pop(tid, None)

    def release_early(self, transfer_id: str) -> None:
        """The consumer no longer wants ``transfer_id``, which is not scheduled here yet."""
        with self._cond:
            self._released_early[transfer_id] = None
            while len(self._released_early) > MAX_EARLY_RELEASES:
                del self._released_early[next(iter(self._released_early))]

    def take_early_release(self, transfer_id: str) -> bool:
        """Whether ``transfer_id`` was released early (forgotten once asked)."""
        with self._cond:
            if transfer_id not in self._released_early:
                return False
            del self._released_early[transfer_id]
            return True

    def is_known(self, ident: str) -> bool:
        with self._cond:
            return ident in self._by_transfer or ident in self._transfer_of

    def resolve(self, ident: str) -> str:
        """The request id a consumer means by ``ident`` (a transfer id, or a request id)."""
        with self._cond:
            stream = self._by_transfer.get(ident)
            return stream.request_id if stream is not None else ident

    # ---- the forward thread -----------------------------------------------------------------

    def begin_forward(self, tokens_after: dict[str, int], num_passes: int) -> None:
        with self._cond:
            self._forward = {rid: n for rid, n in tokens_after.items()
                             if rid in self._transfer_of}
            self._passes = num_passes
            self._saves = [0] * self.num_layers

    def save_layer(self, layer: int) -> None:
        """Layer ``layer``'s attention of the forward (or of one of its micro-batches) ran."""
        with self._cond:
            if not self._forward:
                return
            self._saves[layer] += 1
            if self._saves[layer] == self._passes:
                self._mark(layer)

    def end_forward(self) -> None:
        with self._cond:
            if self._forward:
                for layer in range(self.num_layers):
                    self._mark(layer)
            self._forward = {}

    def _mark(self, layer: int) -> None:
        for rid, tokens in self._forward.items():
            stream = self._by_transfer.get(self._transfer_of.get(rid, ""))
            if stream is not None and not stream.broken:
                stream.layer_tokens[layer] = max(stream.layer_tokens[layer],
                                                 min(tokens, stream.num_prompt_tokens))
        self._cond.notify_all()

    # ---- side-channel threads -----------------------------------------------------------

    def wait_stream(self, transfer_id: str, deadline: float) -> Stream:
        """The stream of ``transfer_id``, once its prompt was scheduled on this instance."""
        with self._cond:
            while (stream := self._by_transfer.get(transfer_id)) is None:
                if not self._cond.wait(deadline - time.monotonic()):
                    if transfer_id not in self._by_transfer:
                        raise TransferError("timeout", f"transfer {transfer_id!r} was not "
                                            "scheduled here before the deadline")
            return stream

    def wait_layer(self, stream: Stream, layer: int, num_tokens: int, deadline: float) -> None:
        """Until ``layer`` holds the first ``num_tokens`` tokens of ``stream``'s prompt."""
        with self._cond:
            while True:
                if stream.broken:
                    raise TransferError("unknown_request", "the prompt was aborted or "
                                        "preempted on the prefill instance")
                if stream.layer_tokens[layer] >= num_tokens:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError("timeout", f"layer {layer} was not written before "
                                        "the deadline")
                self._cond.wait(left)

    def is_broken(self, stream: Stream) -> bool:
        with self._cond:
            return stream.broken
