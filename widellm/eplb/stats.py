"""EPLB load recording: how many (token, expert) selections each physical expert got.

Each rank keeps, per MoE layer and per physical slot, the selections it routed, one row per
engine step in a ring of ``window_size`` steps. The row being written is the current step;
:meth:`ExpertLoadRecorder.step` moves to the next row and zeroes it, so the oldest step drops
out of the window. The window is therefore the current step plus the ``window_size - 1``
steps before it.

    rec = ExpertLoadRecorder(num_layers=2, num_physical=4, window_size=2, device="cpu")
    rec.record(0, torch.tensor([[0, 1], [1, -1]]))   # layer 0: slot 0 once, slot 1 twice
    rec.step()
    rec.record(0, torch.tensor([[3, 3]]))
    rec.window_load()[0]  # tensor([1, 2, 0, 2])
    rec.step()                                        # the first step leaves the window
    rec.window_load()[0]  # tensor([0, 0, 0, 2])

Cheap enough to leave on: :meth:`~ExpertLoadRecorder.record` is a few small elementwise
kernels and one ``scatter_add_`` into a preallocated buffer, with no host sync and no
data-dependent shapes. The write position is a device tensor that :meth:`step` updates in
place, so a ``record`` captured in a CUDA graph keeps writing the current step's row on replay
(``step`` itself runs outside the graph).

Counts are this rank's only; the EP-wide load is ``all_reduce(window_load())``, the caller's
job, so that recording never adds a collective to the forward pass.
"""

from __future__ import annotations

import torch


class ExpertLoadRecorder:
    """Sliding-window per-layer, per-physical-expert selection counts of one rank.

    Args:
        num_layers: MoE layers recorded (``layer`` in :meth:`record` is ``0..num_layers-1``).
        num_physical: physical expert slots per layer, over all ranks (the ids the dispatcher
            sees after logical -> physical mapping).
        window_size: steps kept (>= 1).
        device: where the counts live; ``record`` takes ids on this device.
    """

    def __init__(
        self, num_layers: int, num_physical: int, window_size: int, device: torch.device | str = "cpu"
    ) -> None:
        if num_layers < 1 or num_physical < 1 or window_size < 1:
            raise ValueError(
                f"num_layers={num_layers}, num_physical={num_physical} and "
                f"window_size={window_size} must all be >= 1"
            )
        self.num_layers = num_layers
        self.num_physical = num_physical
        self.window_size = window_size
        self.device = torch.device(device)
        # [window_size, num_layers, num_physical]: row w holds one step's counts.
        self._counts = torch.zeros(
            window_size, num_layers, num_physical, dtype=torch.int64, device=self.device
        )
        # _bases[w, l]: flat offset of (row w, layer l) in _counts; _base is the current row's,
        # updated in place by step() so its address never changes (CUDA-graph safe).
        row = torch.arange(window_size, device=self.device).unsqueeze(1) * (num_layers * num_physical)
        self._bases = row + torch.arange(num_layers, device=self.device) * num_physical
        self._base = self._bases[0].clone()
        self._cursor = 0

    def record(self, layer: int, physical_ids: torch.Tensor) -> None:
        """Add one forward's selections of ``layer`` to the current step.

        Args:
            layer: MoE layer index in ``[0, num_layers)``.
            physical_ids: ``[T, k]`` (any shape) int32/int64 physical slot ids in
                ``[0, num_physical)`` on the recorder's device; ``-1`` marks padding and is
                not counted.
        """
        flat = physical_ids.reshape(-1)
        valid = flat.ge(0)
        # Padding points at slot 0 of the layer with weight 0, so the shape stays fixed.
        index = flat.clamp(min=0) + self._base[layer]
        self._counts.view(-1).scatter_add_(0, index, valid.to(torch.int64))

    def record_counts(self, layer: int, counts: torch.Tensor) -> None:
        """Add already-counted selections to the current step: ``counts`` is ``[num_physical]``
        int64 per physical slot (the simulator's routing model counts, it has no ids).
        Not for CUDA graphs: it indexes the current row from the host."""
        self._counts[self._cursor, layer] += counts.to(self._counts.device, torch.int64)

    def step(self) -> None:
        """Close the current step: move to the next ring row and zero it (the oldest step)."""
        self._cursor = (self._cursor + 1) % self.window_size
        self._counts[self._cursor].zero_()
        self._base.copy_(self._bases[self._cursor])

    def window_load(self) -> torch.Tensor:
        """``[num_layers, num_physical]`` int64 selections over the window, this rank only
        (a new tensor; all-reduce it over the EP group for the global load)."""
        return self._counts.sum(dim=0)

    def reset(self) -> None:
        """Forget every count; the next record starts a fresh window."""
        self._counts.zero_()
        self._cursor = 0
        self._base.copy_(self._bases[0])
