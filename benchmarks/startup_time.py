"""Start-up time of two checkouts, side by side: ``widellm serve`` (the default model, until
``/v1/models`` answers) and an offline ``LLM`` at DP2 + EP2 on a tiny preset (until the
constructor returns), each round alternating which checkout goes first.

    python benchmarks/startup_time.py --sides OLD_CHECKOUT NEW_CHECKOUT --rounds 3

Each side runs with its own checkout first on ``PYTHONPATH`` and this checkout's virtualenv
interpreter; prints one line per run and the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx
from serve_compare import free_port  # this folder is on sys.path when run as a script

READY_TIMEOUT_S = 300.0
POLL_S = 0.1
OFFLINE = """
import time
from widellm.engine.llm import LLM
def main():
    t = time.monotonic()
    llm = LLM("preset:deepseek-v3-tiny", dtype="float32", num_kv_blocks=128, max_model_len=256,
              data_parallel_size=2, enable_expert_parallel=True)
    print(time.monotonic() - t)
    llm.shutdown()
if __name__ == "__main__":
    main()
"""


def env_for(checkout: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.path.abspath(checkout),
            "WIDELLM_LOGGING_LEVEL": "WARNING"}


def serve_seconds(checkout: str) -> float:
    port = free_port()
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "widellm", "serve", "--port", str(port)],
                            env=env_for(checkout), cwd=checkout, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - start < READY_TIMEOUT_S:
            if proc.poll() is not None:
                raise RuntimeError(f"server of {checkout} exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            time.sleep(POLL_S)
        raise TimeoutError(f"server of {checkout} not ready in {READY_TIMEOUT_S} s")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def offline_seconds(checkout: str) -> float:
    done = subprocess.run([sys.executable, "-c", OFFLINE], env=env_for(checkout), cwd=checkout,
                          capture_output=True, text=True, timeout=READY_TIMEOUT_S, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", nargs=2, required=True, metavar="CHECKOUT")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = args.sides if r % 2 == 0 else args.sides[::-1]
        for what, fn in (("serve", serve_seconds), ("offline-dp2", offline_seconds)):
            for side in order:
                seconds = fn(side)
                results.setdefault((what, side), []).append(seconds)
                print(f"round {r} {what} {side}: {seconds:.2f} s", flush=True)
    for (what, side), values in results.items():
        print(f"median {what} {side}: {statistics.median(values):.2f} s over {len(values)}")


if __name__ == "__main__":
    main()
