"""The engine side a GPU check script compares or times, shared by the scripts of check.sh.

``--device cuda``: the CUDA engine, admitted although ``--device auto`` does not pick it yet
(``WIDELLM_UNVERIFIED_CUDA``: these scripts are its check), with its default CUDA graphs.
``--device cpu``: the same script on a machine without a GPU, its graph cases replayed through
the graph runner's eager twin (``WIDELLM_TEST_EAGER_GRAPHS``) at ``cpu_graph_sizes``; a check
of the script, not a measurement.
"""

from __future__ import annotations

import os

from widellm.device import UNVERIFIED_CUDA_ENV
from widellm.worker.model_runner import TEST_EAGER_GRAPHS_ENV


def engine_side(device: str, cpu_graph_sizes: str) -> dict:
    """Set this process's environment for ``device``; returns the engine arguments that give
    its graph case (empty on CUDA: the defaults capture graphs)."""
    os.environ[UNVERIFIED_CUDA_ENV] = "1"
    if device != "cpu":
        return {}
    os.environ[TEST_EAGER_GRAPHS_ENV] = "1"
    return {"cuda_graph_sizes": cpu_graph_sizes}
