"""`widellm serve` for benchmarks/metrics_cost.sh, with or without the request histograms
that vLLM's V1 metric set added (queue / prefill / decode / inference time, TPOT, request
sizes and parameters, iteration tokens). "without" builds the server's EngineMetrics with
``request_histograms=False``, a constructor option no flag reaches; everything else,
including the counters and latency histograms that existed before, runs unchanged.

Usage: python benchmarks/metrics_cost_server.py {with,without} [widellm serve arguments]
"""

from __future__ import annotations

import sys

from widellm.engine.metrics import EngineMetrics
from widellm.entrypoints.cli import main

MODES = ("with", "without")


def _without_request_histograms() -> None:
    for_config = EngineMetrics.for_config.__func__

    def patched(cls, config, **kwargs):
        return for_config(cls, config, **{**kwargs, "request_histograms": False})

    EngineMetrics.for_config = classmethod(patched)


if __name__ == "__main__":  # engine cores are spawned: they re-import this file
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        sys.exit(__doc__)
    if sys.argv[1] == "without":
        _without_request_histograms()
    main(["serve", *sys.argv[2:]])
