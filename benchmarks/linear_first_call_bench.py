"""What a new row count costs a packed (oneDNN) linear: the first, second and third call at
each row count, summed over SmolLM2-135M's four linear shapes of one decoder layer (the 30
layers share them, so a step at a new row count pays this once), bf16, both cores::

    .venv/bin/python benchmarks/linear_first_call_bench.py [--rows 257 700 1500]

oneDNN builds and caches a kernel per (weight shape, row count) on first use; this is why
prompt-carrying steps are padded to a few row counts (``--prefill-pad-multiple``).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from widellm.layers.linear import pack_linear, packed_linear_available

# (in_features, out_features) of qkv_proj, o_proj, gate_up_proj, down_proj.
SMOLLM2_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
CALLS = 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[257, 700, 1500])
    args = p.parse_args()
    if not packed_linear_available():
        raise SystemExit("oneDNN bf16 linears are not available here")
    linears = []
    for n_in, n_out in SMOLLM2_SHAPES:
        lin = nn.Linear(n_in, n_out, bias=False).to(torch.bfloat16)
        pack_linear(lin)
        linears.append(lin)
    with torch.inference_mode():
        for rows in args.rows:
            inputs = [torch.zeros(rows, lin.in_features, dtype=torch.bfloat16) for lin in linears]
            times = []
            for _ in range(CALLS):
                start = time.perf_counter()
                for lin, x in zip(linears, inputs):
                    lin(x)
                times.append((time.perf_counter() - start) * 1e3)
            print(f"{rows:5d} rows: " + " / ".join(f"{t:.1f}" for t in times)
                  + f" ms (calls 1-{CALLS}), first-call extra {times[0] - min(times[1:]):.1f} ms")


if __name__ == "__main__":
    main()
