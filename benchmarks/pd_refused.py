"""Prefill blocks left held by requests a decode instance refuses, with a router that is not
``widellm proxy`` (the shape of vLLM's example proxy: ask the prefill instance for one token
with ``do_remote_decode``, then send the decode instance the request with the returned
``kv_transfer_params``). Starts one prefill and one decode instance (TCPConnector), sends
``--requests`` requests that the decode instance refuses (400 / 404: a negative ``max_tokens``,
a bad ``temperature`` type, an unknown model, ``n: 2``), and prints the prefill instance's
``widellm:kv_transfer_blocks_held`` right after and ``--wait`` seconds later.

    .venv/bin/python benchmarks/pd_refused.py [--requests 20] [--base-port 8400]

Run from a checkout's root (``cd`` to a git worktree of older code to measure it: the
servers are started with ``python -m widellm.entrypoints.cli`` from the current folder).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import httpx

START_TIMEOUT_S = 300.0
POLL_S = 1.0
REQUEST_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
REFUSALS = ({"max_tokens": -1}, {"temperature": "hot"}, {"model": "nope"}, {"n": 2})
HELD = "widellm:kv_transfer_blocks_held{"


def _serve(args, port: int, role: str, blocks: int, extra: dict, log: str) -> subprocess.Popen:
    kv = {"kv_connector": "TCPConnector", "kv_role": role, "kv_connector_extra_config": extra}
    cmd = [sys.executable, "-m", "widellm.entrypoints.cli", "serve", args.model, "--dtype",
           "float32", "--max-model-len", "512", "--port", str(port), "--num-kv-blocks",
           str(blocks), "--kv-transfer-config", json.dumps(kv)]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_up(url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(POLL_S)
    raise SystemExit(f"{url} did not start within {START_TIMEOUT_S:g} s")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its own session: the server and its engine cores
    except ProcessLookupError:
        pass


def _held(url: str) -> float:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(HELD))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="preset:deepseek-v3-tiny")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--wait", type=float, default=2.0)
    parser.add_argument("--base-port", type=int, default=8400)
    parser.add_argument("--log-dir", default=".")
    args = parser.parse_args()
    p_port, d_port = args.base_port, args.base_port + 1
    prefill, decode = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    procs = [_serve(args, p_port, "kv_producer", 256, {"side_channel_port": args.base_port + 2},
                    os.path.join(args.log_dir, "pd_refused_prefill.log")),
             _serve(args, d_port, "kv_consumer", 64, {},
                    os.path.join(args.log_dir, "pd_refused_decode.log"))]
    try:
        _wait_up(prefill)
        _wait_up(decode)
        statuses = set()
        for i in range(args.requests):
            prompt = [3 + (7 * i + j) % 200 for j in range(40 + i)]  # a new prompt each time
            r = httpx.post(prefill + "/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
                "prompt": prompt, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True}})
            r.raise_for_status()
            r = httpx.post(decode + "/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
                "prompt": prompt, "max_tokens": 8, **REFUSALS[i % len(REFUSALS)],
                "kv_transfer_params": r.json()["kv_transfer_params"]})
            statuses.add(r.status_code)
        right_after = _held(prefill)
        time.sleep(args.wait)
        print(json.dumps({"statuses": sorted(statuses), "held_right_after": right_after,
                          f"held_after_{args.wait:g}_s": _held(prefill)}))
    finally:
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()


if __name__ == "__main__":
    main()
