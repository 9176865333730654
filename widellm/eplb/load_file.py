"""A recorded expert load on disk: what offline EPLB keeps from one run (``save_path``) and
places the experts by at the start of the next (``load_path``).

One format for every recorded routing in widellm: this file is also what
``benchmarks/record_routing.py`` writes and ``widellm simulate --expert-skew recorded:FILE``
replays, so a serving run's load can drive the simulator and a recorded one can place a
deployment's experts. One JSON object, readable and editable by hand::

    {"format": "widellm.routing_counts.v1", "num_experts": 4, "top_k": 2,
     "num_steps": 16, "num_tokens": [14, 8], "counts": [[10, 0, 3, 3], [1, 1, 1, 13]]}

``counts[l][e]``: the (token, expert) selections of logical expert ``e`` in MoE layer ``l``
(the model's MoE layers in order, dense layers not counted), summed over the EP group and
over ``num_steps`` engine steps; ``num_tokens[l]`` the tokens behind them. Logical ids, not
slots, so the file holds for any number of ranks or redundant experts the next deployment
has. Reading needs only ``format`` and ``counts``.
"""

from __future__ import annotations

import json
import os

import torch

ROUTING_COUNTS_FORMAT = "widellm.routing_counts.v1"


def save_expert_load(path: str, load: torch.Tensor, top_k: int, num_steps: int) -> None:
    """Write ``load`` (``[L, E]`` integer counts of a router picking ``top_k`` experts per
    token) to ``path``, replacing it atomically (a reader, or a crash mid-write, never sees
    half a file)."""
    if load.dim() != 2:
        raise ValueError(f"expert load must be [layers, experts], got {tuple(load.shape)}")
    load = load.to(torch.int64)
    doc = {"format": ROUTING_COUNTS_FORMAT, "num_experts": load.shape[1], "top_k": top_k,
           "num_steps": num_steps, "num_tokens": (load.sum(1) // top_k).tolist(),
           "counts": load.tolist()}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def load_expert_load(path: str, num_moe_layers: int, num_logical_experts: int) -> torch.Tensor:
    """``[num_moe_layers, num_logical_experts]`` int64 counts from ``path``; a file of another
    model's shape, another format (a torch file included) or with negative counts is a
    ``ValueError`` naming it."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"eplb load_path {path!r}: cannot read it: {e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"eplb load_path {path!r} is not JSON (a torch file?)") from None
    if not isinstance(doc, dict) or doc.get("format") != ROUTING_COUNTS_FORMAT:
        raise ValueError(f"eplb load_path {path!r} is not a {ROUTING_COUNTS_FORMAT} file")
    want = (num_moe_layers, num_logical_experts)
    rows = doc.get("counts")
    if not (isinstance(rows, list) and all(isinstance(r, list) for r in rows)
            and all(type(x) is int for r in rows for x in r)):
        raise ValueError(f"eplb load_path {path!r}: 'counts' is not a table of integers")
    try:
        load = torch.tensor(rows, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError):  # ragged rows
        raise ValueError(f"eplb load_path {path!r}: 'counts' is not a table of integers") from None
    if tuple(load.shape) != want:
        raise ValueError(f"eplb load_path {path!r} holds {tuple(load.shape)} (MoE layers, "
                         f"experts); this model has {want}")
    if bool((load < 0).any()):
        raise ValueError(f"eplb load_path {path!r}: counts must be >= 0")
    return load
