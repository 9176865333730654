"""Which experts the simulated tokens pick: uniform, Zipf-skewed, or replayed from the
per-layer expert counts of a real widellm run (``benchmarks/record_routing.py`` on one rank,
or an EP deployment's ``--eplb-config`` ``save_path``; the format is ``eplb/load_file.py``'s).

Every kind is reduced to one table per MoE layer: ``inclusion[l, e]``, the probability that a
token of layer ``l`` picks expert ``e``. A token picks ``top_k`` *distinct* experts, so
``inclusion[l].sum() == top_k`` and no entry exceeds 1.

Sampling is systematic (Madow's) sampling, which gives each token exactly ``top_k`` distinct
experts with exactly these inclusion probabilities, at the cost of one uniform draw per token:
lay the experts on a line, expert ``e`` owning a segment of length ``inclusion[l, e]`` (total
length ``top_k``); a token draws ``u`` in ``[0, 1)`` and picks the experts whose segments hold
``u, u + 1, ..., u + top_k - 1``. No segment is longer than 1, so no expert is hit twice. The
line's order of experts is shuffled on every call, so which experts tend to be picked
together changes from step to step instead of being fixed by the table's order. Segments are
integers (``SEGMENT_UNITS`` per unit of length), which makes "no longer than 1" exact.

Zipf(s): the expert of popularity rank ``r`` (0 = hottest) gets a share of the routed copies
proportional to ``(r + 1) ** -s``; each layer ranks the experts in its own seeded random order
so the hot experts differ between layers. A share above one copy per token (possible for large
``s``) is capped at 1 and the excess spread over the others in proportion to their shares.
``s = 0`` is uniform.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from widellm.model.flops import moe_layer_ids

ROUTING_KINDS = ("uniform", "zipf", "recorded")
# Integer units per unit of segment length (inclusion probabilities resolved to 2^-24).
SEGMENT_UNITS = 1 << 24
# Seeds the per-layer expert orders of Zipf apart from the simulation's other streams.
_ZIPF_ORDER_STREAM = 11


def moe_dims(hf_config: Any) -> tuple[int, int, int]:
    """``(routed experts, experts per token, MoE layers)`` of a HF config."""
    num_experts = (getattr(hf_config, "n_routed_experts", None)
                   or getattr(hf_config, "num_local_experts", None)
                   or getattr(hf_config, "num_experts", None))
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    if not num_experts or not top_k:
        raise ValueError("the model has no routed experts (n_routed_experts / "
                         "num_experts_per_tok missing from its config)")
    return int(num_experts), int(top_k), max(1, len(moe_layer_ids(hf_config)))


def cap_inclusion(shares: np.ndarray, top_k: int) -> np.ndarray:
    """Inclusion probabilities summing to ``top_k`` with none above 1, proportional to
    ``shares`` (>= 0) except where capped: capped experts' excess goes to the uncapped ones
    in proportion to their shares."""
    shares = np.asarray(shares, dtype=np.float64)
    if (shares < 0).any() or not np.isfinite(shares).all():
        raise ValueError("expert shares must be finite and >= 0")
    positive = int((shares > 0).sum())
    if positive < top_k:
        raise ValueError(f"{positive} experts have load but each token picks {top_k} distinct "
                         "ones")
    capped = np.zeros(len(shares), dtype=bool)
    while True:
        free_mass = top_k - int(capped.sum())
        free_shares = np.where(capped, 0.0, shares)
        if free_mass == 0:  # top_k experts took a whole copy each: the rest get nothing
            return np.where(capped, 1.0, 0.0)
        q = np.where(capped, 1.0, free_mass * free_shares / free_shares.sum())
        over = (q > 1.0) & ~capped
        if not over.any():
            return q
        capped |= over


def _segment_units(inclusion: np.ndarray, top_k: int) -> np.ndarray:
    """``inclusion`` as integer segment lengths: each <= SEGMENT_UNITS, summing to exactly
    ``top_k * SEGMENT_UNITS`` (largest-remainder rounding)."""
    scaled = inclusion * SEGMENT_UNITS
    units = np.floor(scaled).astype(np.int64)
    units = np.minimum(units, SEGMENT_UNITS)
    deficit = top_k * SEGMENT_UNITS - int(units.sum())
    room = units < SEGMENT_UNITS
    if deficit < 0 or deficit > int(room.sum()):
        raise ValueError("inclusion probabilities do not sum to top_k")
    remainders = np.where(room, scaled - units, -1.0)
    units[np.argsort(-remainders, kind="stable")[:deficit]] += 1
    return units


def _zipf_inclusion(s: float, num_experts: int, top_k: int, num_layers: int,
                    seed: int) -> np.ndarray:
    by_rank = (np.arange(num_experts) + 1.0) ** -s
    table = np.empty((num_layers, num_experts))
    for layer in range(num_layers):
        order = np.random.default_rng([seed, _ZIPF_ORDER_STREAM, layer]).permutation(num_experts)
        shares = np.empty(num_experts)
        shares[order] = by_rank  # order[r] is the layer's expert of popularity rank r
        table[layer] = cap_inclusion(shares, top_k)
    return table


def load_recorded_counts(path: str) -> np.ndarray:
    """``[layers, experts]`` counts from a JSON file (``{"counts": [[...], ...]}`` or a bare
    list of lists) or a torch file (that dict, or a tensor)."""
    if path.endswith((".pt", ".pth")):
        import torch

        content = torch.load(path, map_location="cpu", weights_only=True)
    else:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    if isinstance(content, dict):
        if "counts" not in content:
            raise ValueError(f"{path}: no 'counts' in the routing file")
        content = content["counts"]
    counts = np.asarray(content.tolist() if hasattr(content, "tolist") else content,
                        dtype=np.float64)
    if counts.ndim != 2 or counts.shape[0] < 1 or counts.shape[1] < 1:
        raise ValueError(f"{path}: counts must be [layers, experts], got shape {counts.shape}")
    return counts


@dataclass(frozen=True, eq=False)
class ExpertRouting:
    """Routed expert choice of simulated tokens (see the module docstring).

    Attributes:
        inclusion: ``[layers, experts]`` probability that a token picks each expert.
        top_k: experts per token.
        spec: the spec string it was built from (``uniform``, ``zipf:S``, ``recorded:PATH``).
    """

    inclusion: np.ndarray
    top_k: int
    spec: str = "uniform"

    def __post_init__(self) -> None:
        table = np.asarray(self.inclusion, dtype=np.float64)
        if table.ndim != 2:
            raise ValueError(f"inclusion must be [layers, experts], got shape {table.shape}")
        if not 1 <= self.top_k <= table.shape[1]:
            raise ValueError(f"top_k={self.top_k} must be in [1, {table.shape[1]}]")
        # Integer segments per layer, computed once; they also validate the table.
        units = np.stack([_segment_units(row, self.top_k) for row in table])
        object.__setattr__(self, "inclusion", table)
        object.__setattr__(self, "_units", units)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def uniform(cls, num_experts: int, top_k: int, num_layers: int = 1) -> "ExpertRouting":
        return cls(np.full((num_layers, num_experts), top_k / num_experts), top_k, "uniform")

    @classmethod
    def zipf(cls, s: float, num_experts: int, top_k: int, num_layers: int = 1,
             seed: int = 0) -> "ExpertRouting":
        if s < 0:
            raise ValueError(f"zipf exponent must be >= 0, got {s}")
        return cls(_zipf_inclusion(s, num_experts, top_k, num_layers, seed), top_k, f"zipf:{s:g}")

    @classmethod
    def recorded(cls, path: str, num_experts: int, top_k: int,
                 num_layers: int = 1) -> "ExpertRouting":
        """Layer ``l`` replays the file's layer ``l % file_layers`` (a file from a shallower
        model repeats its layers); the file must have ``num_experts`` experts."""
        counts = load_recorded_counts(path)
        if counts.shape[1] != num_experts:
            raise ValueError(f"{path}: {counts.shape[1]} experts recorded, the model has "
                             f"{num_experts}")
        rows = [cap_inclusion(counts[layer % counts.shape[0]], top_k)
                for layer in range(num_layers)]
        return cls(np.stack(rows), top_k, f"recorded:{path}")

    @classmethod
    def from_spec(cls, spec: str, num_experts: int, top_k: int, num_layers: int = 1,
                  seed: int = 0) -> "ExpertRouting":
        """``uniform``, ``zipf:S`` (e.g. ``zipf:1.2``) or ``recorded:PATH``."""
        kind, _, arg = spec.partition(":")
        if kind == "uniform" and not arg:
            return cls.uniform(num_experts, top_k, num_layers)
        if kind == "zipf" and arg:
            try:
                s = float(arg)
            except ValueError:
                raise ValueError(f"expert skew {spec!r}: zipf:S needs a number") from None
            return cls.zipf(s, num_experts, top_k, num_layers, seed)
        if kind == "recorded" and arg:
            if not os.path.isfile(arg):
                raise ValueError(f"expert skew {spec!r}: no file {arg}")
            return cls.recorded(arg, num_experts, top_k, num_layers)
        raise ValueError(f"expert skew {spec!r}: use uniform, zipf:S or recorded:FILE")

    # ---- shape ----------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.inclusion.shape[0]

    @property
    def num_experts(self) -> int:
        return self.inclusion.shape[1]

    def to_dict(self) -> dict:
        return {"spec": self.spec, "num_layers": self.num_layers,
                "num_experts": self.num_experts, "top_k": self.top_k}

    # ---- sampling -------------------------------------------------------------------------

    def sample_experts(self, num_tokens: int, rng: np.random.Generator,
                       layer: int | None = None) -> np.ndarray:
        """``[num_tokens, top_k]`` int64 expert ids, distinct within each row, of ``layer``
        (None: layer 0)."""
        units = self._units[0 if layer is None else layer % self.num_layers]
        order = rng.permutation(self.num_experts)
        bounds = np.cumsum(units[order])  # segment of order[i] is [bounds[i-1], bounds[i])
        start = rng.integers(0, SEGMENT_UNITS, size=num_tokens, dtype=np.int64)
        points = start[:, None] + np.arange(self.top_k, dtype=np.int64) * SEGMENT_UNITS
        return order[np.searchsorted(bounds, points, side="right")]

    def counts(self, tokens_per_rank: np.ndarray, rng: np.random.Generator,
               layer: int | None = None) -> np.ndarray:
        """``[ranks, experts]`` int64: routed token copies each source rank sends to each
        logical expert in ``layer`` (None: layer 0); row ``r`` sums to
        ``tokens_per_rank[r] * top_k``."""
        tokens = np.asarray(tokens_per_rank, dtype=np.int64)
        if tokens.ndim != 1 or (tokens < 0).any():
            raise ValueError("tokens_per_rank must be a 1-D array of counts >= 0")
        num_ranks, num_experts = len(tokens), self.num_experts
        experts = self.sample_experts(int(tokens.sum()), rng, layer)
        source = np.repeat(np.arange(num_ranks, dtype=np.int64), tokens)
        flat = (source[:, None] * num_experts + experts).ravel()
        return np.bincount(flat, minlength=num_ranks * num_experts).reshape(num_ranks,
                                                                            num_experts)
