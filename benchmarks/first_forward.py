"""The first forward at a prompt-step row count against the second, on one rank: what a rank
pays the first time it meets a padded size (oneDNN kernels, first-touched memory), which under
expert parallelism its peers would wait for at the next exchange; and, with
``--async-scheduling``, whether the runner thread's forwards cost what the main thread's do
(CPU time and page faults of the thread that ran them)::

    .venv/bin/python benchmarks/first_forward.py [--model preset:deepseek-v3-small] \
        [--rows 4032 3008]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/first_forward.py --rows 4032 --repeat 3 \
        [--async-scheduling]

Each size runs ``ModelRunner.warmup([rows])`` ``--repeat`` times on the thread that runs the
forwards (a padding-only batch through every layer and the LM head).
"""

from __future__ import annotations

import argparse
import resource
import time

from widellm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="preset:deepseek-v3-small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[4032, 3008, 2752])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="forwards on the async runner thread (default: the main thread)")
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory="2GiB", enforce_eager=True,
              async_scheduling=args.async_scheduling)
    try:
        core = llm.llm_engine.engine_core
        if core is None:
            raise SystemExit("needs one rank with its engine core in this process")

        def forward(rows: int) -> tuple[float, float, int]:
            # (wall s, this thread's CPU s, this thread's minor page faults)
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            wall, cpu = time.perf_counter(), time.thread_time()
            core.model_runner.warmup([rows])
            return (time.perf_counter() - wall, time.thread_time() - cpu,
                    resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults)

        thread = "runner thread" if args.async_scheduling else "main thread"
        for rows in args.rows:
            runs = [core._on_runner_thread(forward, rows) for _ in range(args.repeat)]
            ratio = f"; first / second {runs[0][0] / runs[1][0]:.2f}x" if len(runs) > 1 else ""
            print(f"{rows} rows on the {thread}: " + ", ".join(
                f"{wall:.3f} s ({cpu:.3f} s CPU, {faults} page faults)"
                for wall, cpu, faults in runs) + ratio)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
