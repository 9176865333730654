"""The command line, run as a user would: a subprocess on a tiny preset."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

WIDELLM = [sys.executable, "-m", "widellm.entrypoints.cli"]


def run_cli(args: list[str], model_cache: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, WIDELLM_CACHE_DIR=model_cache)
    return subprocess.run(WIDELLM + args, capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_generate_prints_the_greedy_completion(model_dir, tmp_path):
    path = model_dir("LlamaForCausalLM")
    proc = run_cli(["generate", "hello world", "--model", path, "--dtype", "float32",
                    "--max-tokens", "6", "--num-kv-blocks", "256"], str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    from widellm import LLM, SamplingParams

    expected = LLM(path, dtype="float32", num_kv_blocks=256).generate(
        "hello world", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )[0].outputs[0].text
    assert proc.stdout == expected + "\n"
    assert "KV cache: 256 blocks x 16 tokens = 4096 tokens" in proc.stderr


def test_bench_throughput_writes_json(model_dir, tmp_path):
    out = tmp_path / "r.json"
    proc = run_cli(["bench", "throughput", "--model", model_dir("DeepseekV3ForCausalLM"),
                    "--input-len", "16", "--output-len", "8", "--num-prompts", "4",
                    "--dtype", "float32", "--num-kv-blocks", "256",
                    "--output-json", str(out)], str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert (result["num_prompts"], result["input_len"], result["output_len"]) == (4, 16, 8)
    assert result["output_tokens_per_s"] > 0
    assert result["total_tokens_per_s"] > result["output_tokens_per_s"]
    assert "output tok/s" in proc.stdout


def test_bad_flag_value_exits_with_message(tmp_path):
    proc = run_cli(["generate", "hi", "--model", "/no/such/model"], str(tmp_path))
    assert proc.returncode == 2
    assert "/no/such/model" in proc.stderr


def test_serve_step_budget_defaults_to_vllms_api_server_one():
    """`widellm serve` prefills with a 2,048-token step budget (vLLM's API server on CPU),
    the offline commands with the engine's 4,096; an explicit flag wins in both."""
    from widellm.entrypoints.cli import build_parser
    from widellm.entrypoints.server_args import SERVE_MAX_NUM_BATCHED_TOKENS

    parser = build_parser()
    assert SERVE_MAX_NUM_BATCHED_TOKENS == 2048
    assert parser.parse_args(["serve"]).max_num_batched_tokens == 2048
    assert parser.parse_args(["serve", "--max-num-batched-tokens", "4096"]) \
        .max_num_batched_tokens == 4096
    assert parser.parse_args(["generate", "hi"]).max_num_batched_tokens == 4096


def test_engine_ready_timeout_is_a_flag(model_dir, tmp_path):
    """A core that is not ready within --engine-ready-timeout-s fails the start with a message
    naming the rank and the flag (spawning a core and importing torch alone take longer
    than the half second given here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_cli(["serve", model_dir("LlamaForCausalLM"), "--dtype", "float32",
                    "--num-kv-blocks", "256", "--port", str(port),
                    "--engine-ready-timeout-s", "0.5"], str(tmp_path), timeout=120)
    assert proc.returncode != 0
    assert "engine cores [0] not ready after" in proc.stderr, proc.stderr
    assert "raise --engine-ready-timeout-s" in proc.stderr
