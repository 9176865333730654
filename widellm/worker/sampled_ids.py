"""Sampled token ids: left on the device for the next step, and handed to the host off the
step's critical path.

Under async scheduling on a GPU the runner queues step N+1 while the engine core still turns
step N's samples into outputs. Step N+1's inputs take N's sampled ids from the device
(:class:`DeviceSampledIds`), so only two readers need them on the host: the engine core (its
requests' outputs) and the runner's own request states. Neither needs them before N+1's
forward is queued, so with deferral (:class:`SampledIdsHandoff`) N's sample step starts an
asynchronous copy to pinned host memory and returns without waiting for it:

- the runner appends a placeholder (``PLACEHOLDER_TOKEN_ID``) to each sampled request's token
  list; a later step's input that is a placeholder gets the device value (:meth:`feed`), and
  the next sample step writes the real values in (:meth:`settle`) before anything on the host
  reads them (penalties, grammars, logprobs);
- the runner's output carries a resolver that the engine core calls on its own thread
  (``ModelRunnerOutput.resolve``): it waits for the copy, not for the GPU's later work.

A step that needs its values on the host at once (a structured-output grammar advances on
them, or logprobs are asked for) resolves them at once, as without deferral. On a CPU the copy
is the tensor itself and deferral only reorders the work, which is how the CPU tests check it
(``WIDELLM_TEST_DEFER_SAMPLED_IDS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from widellm.worker.input_batch import BatchInputs, CachedRequestState

# What a request's token list holds for a token sampled on the device and not yet copied back.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class DeviceSampledIds:
    """One step's sampled token ids, left on the device, and their copy to the host.

    Attributes:
        token_ids: ``[num_sampled]`` int64 on the engine's device, in sampling order.
        index_of: request id -> its position in ``token_ids``.
    """

    token_ids: torch.Tensor
    index_of: dict[str, int] = field(default_factory=dict)
    _host: torch.Tensor | None = None
    _copied: Any = None  # the CUDA event after the copy
    _tokens: list[int] | None = None

    def start_host_copy(self) -> "DeviceSampledIds":
        """Queue the copy to the host behind the sampling (pinned memory, no wait)."""
        if self.token_ids.is_cuda:
            self._host = torch.empty(self.token_ids.shape, dtype=self.token_ids.dtype,
                                     pin_memory=True)
            self._host.copy_(self.token_ids, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = self.token_ids
        return self

    def host_tokens(self) -> list[int]:
        """The ids as a list, waiting for the copy (not for later device work). Safe to call
        from two threads: both read the same finished copy."""
        if self._tokens is None:
            if self._host is None:
                self.start_host_copy()
            if self._copied is not None:
                self._copied.synchronize()
            self._tokens = self._host.tolist()
        return self._tokens


@dataclass
class _Held:
    """A placeholder: ``state.token_ids[position]`` is ``pending.token_ids[index]``."""

    state: CachedRequestState
    position: int
    index: int


class SampledIdsHandoff:
    """The runner's placeholders for the last deferred step (see the module docstring).

    Args:
        enabled: defer at all (CUDA engines with async scheduling; the CPU tests' flag).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.pending: DeviceSampledIds | None = None
        self._held: dict[str, _Held] = {}

    def defer(self, sampled: DeviceSampledIds, states: dict[str, CachedRequestState],
              req_ids: list[str]) -> None:
        """Start ``sampled``'s host copy and hold one placeholder per request of ``req_ids``
        (sampling order). The previous deferred step must be settled."""
        if self.pending is not None:
            raise RuntimeError("settle the previous step's sampled ids first")
        self.pending = sampled.start_host_copy()
        for j, req_id in enumerate(req_ids):
            state = states[req_id]
            self._held[req_id] = _Held(state, len(state.token_ids), j)
            state.token_ids.append(PLACEHOLDER_TOKEN_ID)

    def settle(self) -> None:
        """Write the held steps' real ids into the request states (a state dropped since,
        finished or preempted, takes the write harmlessly)."""
        if self.pending is None:
            return
        tokens = self.pending.host_tokens()
        for held in self._held.values():
            held.state.token_ids[held.position] = tokens[held.index]
        self.pending, self._held = None, {}

    def feed(self, batch: BatchInputs, input_ids: torch.Tensor,
             states: dict[str, CachedRequestState]) -> torch.Tensor:
        """``input_ids`` (the batch's flattened rows, padding after them) with the device's
        value at every held placeholder it holds, in place."""
        if self.pending is None:
            return input_ids
        dst, src = [], []
        offset = 0
        for i, req_id in enumerate(batch.req_ids):
            rows = int(batch.query_lens[i])
            held = self._held.get(req_id)
            start = int(batch.context_lens[i]) - rows
            if (held is not None and states.get(req_id) is held.state
                    and start <= held.position < start + rows):
                dst.append(offset + held.position - start)
                src.append(held.index)
            offset += rows
        if dst:
            device = input_ids.device
            dst_t = torch.tensor(dst, dtype=torch.int64).to(device, non_blocking=True)
            src_t = torch.tensor(src, dtype=torch.int64).to(device, non_blocking=True)
            input_ids.index_copy_(0, dst_t, self.pending.token_ids.index_select(0, src_t))
        return input_ids
