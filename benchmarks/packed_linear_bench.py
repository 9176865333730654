"""Plain ``F.linear`` against oneDNN's packed linear (``widellm.layers.linear.PackedLinear``)
for SmolLM2-135M's decoder projections and LM head, per dtype the CPU packs (fp32 always,
bf16 where oneDNN has bf16 kernels), at decode and prompt row counts. Each case cycles through
30 layers' worth of distinct weights, as a decode step does, so that the weights come from
memory rather than the cache::

    .venv/bin/python benchmarks/packed_linear_bench.py [--rows 1 16 64 256 2048] [--output-json FILE]

Prints, per dtype and row count, the time of all 30 layers' projections and of one LM head
call for each path (best of ``--repeats`` means over ``--iters`` rounds, paths interleaved).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench_common import write_result_json
from cpu_kernels_bench import best_ms, parse_bench_args, times_text
from widellm.layers.linear import PACK_BATCH_SIZE_HINT, PACKABLE_DTYPES, packed_linear_available

HIDDEN, INTER, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
# (in_features, out_features) of qkv, o, gate_up and down.
LAYER_SHAPES = ((HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN))


def _packed(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_SIZE_HINT)


def _linear_packed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def cases(args, dtype: torch.dtype) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    plain = [[torch.randn(n, k, generator=g).to(dtype) for k, n in LAYER_SHAPES]
             for _ in range(LAYERS)]
    packed = [[_packed(w) for w in layer] for layer in plain]
    head = torch.randn(VOCAB, HIDDEN, generator=g).to(dtype)
    head_packed = _packed(head)
    out = []
    for rows in args.rows:
        xs = [torch.randn(rows, k, generator=g).to(dtype) for k, _ in LAYER_SHAPES]
        x_head = torch.randn(rows, HIDDEN, generator=g).to(dtype)

        def layers(weights, linear):
            return lambda: [linear(x, w) for layer in weights for x, w in zip(xs, layer)]

        times = best_ms({"F.linear": layers(plain, F.linear),
                         "packed": layers(packed, _linear_packed),
                         "head F.linear": lambda: F.linear(x_head, head),
                         "head packed": lambda: _linear_packed(x_head, head_packed)},
                        args.iters, args.repeats)
        out.append({"dtype": str(dtype), "rows": rows, "ms": times})
        print(f"{str(dtype):15s} rows={rows:5d} " + times_text(times), flush=True)
    return out


def main() -> None:
    args = parse_bench_args(__doc__, lambda p: p.add_argument(
        "--rows", type=int, nargs="+", default=[1, 16, 64, 256, 2048]))
    results = [r for dtype in PACKABLE_DTYPES if packed_linear_available(dtype)
               for r in cases(args, dtype)]
    write_result_json(args.output_json, {"cases": results})


if __name__ == "__main__":
    main()
