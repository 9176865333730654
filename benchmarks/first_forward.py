"""The first forward at a prompt-step row count against the second, on one rank: what a rank
pays the first time it meets a padded size (oneDNN kernels, first-touched memory), which under
expert parallelism its peers would wait for at the next exchange::

    .venv/bin/python benchmarks/first_forward.py [--model preset:deepseek-v3-small] [--rows 4032 3008]

Each size runs ``ModelRunner.warmup([rows])`` twice on the runner thread (a padding-only
batch through every layer and the LM head).
"""

from __future__ import annotations

import argparse
import time

from widellm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="preset:deepseek-v3-small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[4032, 3008, 2752])
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory="2GiB", enforce_eager=True)
    try:
        core = llm.llm_engine.engine_core
        if core is None:
            raise SystemExit("needs one rank with its engine core in this process")

        def timed(rows: int) -> float:
            start = time.perf_counter()
            core._on_runner_thread(core.model_runner.warmup, [rows])
            return time.perf_counter() - start

        for rows in args.rows:
            first, second = timed(rows), timed(rows)
            print(f"{rows} rows: first forward {first:.3f} s, second {second:.3f} s "
                  f"({first / second:.2f}x)")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
