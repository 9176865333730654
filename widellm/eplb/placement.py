"""One MoE layer's expert placement as the router and the weights see it, updated in place.

``phys_to_logical [P]``: logical expert held by each physical slot; ``logical_to_phys [E, M]``
and ``logical_replica_count [E]``: its inverse (``M = P - E + 1``, the most replicas one expert
can have, so shapes never change and a rebalance only copies new values in).

The initial placement is the plain contiguous split of the logical experts over the ranks
(what runs without EPLB), each rank's redundant slots holding replicas of its own experts: no
rank starts with help from another, so the first rebalance must earn any improvement. E.g.
8 experts, 12 slots, 2 ranks: ``[0 1 2 3 0 1 | 4 5 6 7 4 5]``. When the experts do not split
evenly over the ranks, slot ``p`` holds expert ``p mod E``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from widellm.eplb.planner import maps_from_phys_to_logical


@dataclass(eq=False)
class ExpertPlacement:
    phys_to_logical: torch.Tensor  # [P] int64
    logical_to_phys: torch.Tensor  # [E, M] int64, -1 padded
    logical_replica_count: torch.Tensor  # [E] int64

    @classmethod
    def initial(cls, num_logical: int, num_physical: int, num_ranks: int,
                device: torch.device | str | None = None) -> "ExpertPlacement":
        if num_physical < num_logical:
            raise ValueError(f"{num_physical} physical slots cannot hold {num_logical} experts")
        slot = torch.arange(num_physical, dtype=torch.int64)
        if num_logical % num_ranks or num_physical % num_ranks:
            p2l = slot % num_logical
        else:
            own, per_rank = num_logical // num_ranks, num_physical // num_ranks
            p2l = (slot // per_rank) * own + (slot % per_rank) % own
        return cls.from_phys_to_logical(p2l, num_logical, device)

    @classmethod
    def from_phys_to_logical(cls, phys_to_logical: torch.Tensor, num_logical: int,
                             device: torch.device | str | None = None) -> "ExpertPlacement":
        max_replicas = phys_to_logical.numel() - num_logical + 1
        l2p, count = maps_from_phys_to_logical(phys_to_logical.cpu()[None], num_logical,
                                               max_replicas)
        return cls(phys_to_logical.to(device), l2p[0].to(device), count[0].to(device))

    @property
    def num_logical(self) -> int:
        return self.logical_replica_count.numel()

    def update_(self, phys_to_logical: torch.Tensor) -> None:
        """Switch to a new placement in place (same shapes)."""
        new = ExpertPlacement.from_phys_to_logical(phys_to_logical, self.num_logical)
        self.phys_to_logical.copy_(new.phys_to_logical)
        self.logical_to_phys.copy_(new.logical_to_phys)
        self.logical_replica_count.copy_(new.logical_replica_count)

    def local_slots(self, logical_id: int, rank: int, slots_per_rank: int) -> list[int]:
        """This rank's local slot indices that hold ``logical_id``."""
        mine = self.phys_to_logical[rank * slots_per_rank:(rank + 1) * slots_per_rank]
        return torch.nonzero(mine.cpu() == logical_id).flatten().tolist()
