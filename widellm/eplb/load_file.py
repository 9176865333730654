"""A recorded expert load on disk: what offline EPLB keeps from one run (``save_path``) and
places the experts by at the start of the next (``load_path``).

The file is one JSON object, readable and editable by hand::

    {"format": "widellm-expert-load", "version": 1,
     "num_moe_layers": 2, "num_logical_experts": 4, "num_steps": 16,
     "load": [[10, 0, 3, 3], [1, 1, 1, 13]]}

``load[l][e]``: the (token, expert) selections of logical expert ``e`` in MoE layer ``l``
(the model's MoE layers in order, dense layers not counted), summed over the EP group and
over ``num_steps`` engine steps. Logical ids, not slots, so the file holds for any number of
ranks or redundant experts the next deployment has.
"""

from __future__ import annotations

import json
import os

import torch

FORMAT = "widellm-expert-load"
VERSION = 1


def save_expert_load(path: str, load: torch.Tensor, num_steps: int) -> None:
    """Write ``load`` (``[L, E]`` integer counts) to ``path``, replacing it atomically (a
    reader, or a crash mid-write, never sees half a file)."""
    if load.dim() != 2:
        raise ValueError(f"expert load must be [layers, experts], got {tuple(load.shape)}")
    doc = {"format": FORMAT, "version": VERSION, "num_moe_layers": load.shape[0],
           "num_logical_experts": load.shape[1], "num_steps": num_steps,
           "load": load.to(torch.int64).tolist()}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def load_expert_load(path: str, num_moe_layers: int, num_logical_experts: int) -> torch.Tensor:
    """``[num_moe_layers, num_logical_experts]`` int64 counts from ``path``; a file of another
    model's shape, another format or with negative counts is a ``ValueError`` naming it."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"eplb load_path {path!r}: cannot read it: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"eplb load_path {path!r} is not a {FORMAT} file")
    if doc.get("version") != VERSION:
        raise ValueError(f"eplb load_path {path!r}: version {doc.get('version')!r}, this "
                         f"widellm reads version {VERSION}")
    want = (num_moe_layers, num_logical_experts)
    rows = doc.get("load")
    if not (isinstance(rows, list) and all(isinstance(r, list) for r in rows)
            and all(type(x) is int for r in rows for x in r)):
        raise ValueError(f"eplb load_path {path!r}: 'load' is not a table of integers")
    try:
        load = torch.tensor(rows, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError):  # ragged rows
        raise ValueError(f"eplb load_path {path!r}: 'load' is not a table of integers") from None
    if tuple(load.shape) != want:
        raise ValueError(f"eplb load_path {path!r} holds {tuple(load.shape)} (MoE layers, "
                         f"experts); this model has {want}")
    if bool((load < 0).any()):
        raise ValueError(f"eplb load_path {path!r}: counts must be >= 0")
    return load
