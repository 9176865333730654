"""``widellm bench serve`` run with a ``vllm bench serve`` command line writes a JSON whose
keys are a superset of vLLM's, against a strict third-party OpenAI server (a stub that knows
only OpenAI's fields) and against ``widellm serve``; a rejected test request is a one-line
error, not a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack

import pytest

from tests.bench.bench_utils import bound_socket, parse_bench_args, serve_app, word_level_tokenizer
from tests.bench.openai_stub import CHAT_FIELDS, COMPLETIONS_FIELDS, STUB_MODEL, make_stub_app
from widellm.bench.datasets import random_samples
from widellm.bench.serve import BenchServeError, main
from widellm.model.default_model import DEFAULT_MODEL_NAME

BENCH_SERVE = [sys.executable, "-m", "widellm.entrypoints.cli", "bench", "serve"]
CLI_TIMEOUT_S = 300
VOCAB = 300
# The keys vLLM's ``vllm bench serve`` writes for a generation run, learned from
# vllm/benchmarks/serve.py (vllm-project/vllm at 009e6d4a1cd6ba3fb2a9fc00f4ec06f5297232a1:
# ``main_async`` builds the setup keys, ``benchmark`` the rest).
VLLM_KEYS = (
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "latencies", "queue_times",
    "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
)
# Written only with --save-detailed (``main_async`` drops them otherwise).
VLLM_DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls",
                      "generated_texts", "errors")


def vllm_latency_keys(metrics: list[str], percentiles: list[str]) -> set[str]:
    """``process_one_metric``'s keys for each metric selected by --percentile-metrics."""
    return {f"{stat}_{m}_ms" for m in metrics
            for stat in ["mean", "median", "std", *(f"p{p}" for p in percentiles)]}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("word_tokenizer")
    word_level_tokenizer(path, VOCAB)
    return str(path)


@pytest.fixture
def stub():
    """A fresh strict OpenAI stub per test, stopped at teardown pass or fail: (app, url)."""
    app = make_stub_app()
    with ExitStack() as stack:
        yield app, stack.enter_context(serve_app(app))


def _run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BENCH_SERVE, *argv, "--disable-tqdm"], capture_output=True,
                          text=True, timeout=CLI_TIMEOUT_S)


def test_vllm_command_line_against_a_strict_openai_server(stub, tokenizer_dir, tmp_path):
    app, url = stub
    num_prompts = 6
    proc = _run_cli(
        "--backend", "openai-chat", "--base-url", url, "--dataset-name", "random",
        "--random-input-len", "12", "--random-output-len", "6", "--random-range-ratio", "0.5",
        "--num-prompts", str(num_prompts), "--request-rate", "200", "--burstiness", "0.5",
        "--max-concurrency", "3", "--seed", "11", "--tokenizer", tokenizer_dir,
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99.9",
        "--goodput", "ttft:60000", "e2el:60000", "--temperature", "0.5", "--top-p", "0.9",
        "--save-result", "--save-detailed", "--result-dir", str(tmp_path / "out"),
        "--result-filename", "stub.json", "--metadata", "engine=stub")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "out" / "stub.json").read_text())
    expected = {*VLLM_KEYS, *VLLM_DETAILED_KEYS,
                *vllm_latency_keys(["ttft", "tpot", "itl", "e2el"], ["50", "90", "99.9"])}
    assert expected <= set(result), expected - set(result)
    assert (result["completed"], result["failed"]) == (num_prompts, 0)
    assert len(result["ttfts"]) == len(result["itls"]) == num_prompts
    assert result["errors"] == [""] * num_prompts
    assert (result["backend"], result["model_id"], result["engine"]) == (
        "openai-chat", STUB_MODEL, "stub")
    assert result["tokenizer_id"] == tokenizer_dir and result["burstiness"] == 0.5
    # Every request met both generous SLOs.
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    # Text prompts of the sampled lengths; the stub generated exactly what was asked.
    samples = random_samples(num_prompts, input_len=12, output_len=6, seed=11,
                             range_ratio=0.5, vocab_size=VOCAB, tokenizer=object(),
                             as_text=False)
    assert result["output_lens"] == [s.output_len for s in samples]
    assert result["input_lens"] == [s.prompt_len for s in samples]
    assert result["total_output_tokens"] == sum(s.output_len for s in samples)
    # One gap per word after the first: the stub's closing text-less chunk is no token.
    assert [len(gaps) for gaps in result["itls"]] == [s.output_len - 1 for s in samples]
    assert result["max_concurrent_requests"] <= 3
    # Only OpenAI's fields went out (the stub would have answered 400 otherwise).
    assert len(app.state.payloads) == num_prompts + 1  # with the test request
    for payload in app.state.payloads:
        assert set(payload) <= CHAT_FIELDS
        assert isinstance(payload["messages"][0]["content"], str)
        assert (payload["temperature"], payload["top_p"]) == (0.5, 0.9)
    assert "Serving Benchmark Result" in proc.stdout


def test_completions_default_tokenizer_and_vllm_file_name(stub, tmp_path):
    app, url = stub
    result = main(parse_bench_args(
        "--base-url", url, "--num-prompts", "3", "--input-len", "10", "--output-len", "4",
        "--max-concurrency", "2", "--request-rate", "100", "--label", "lab",
        "--save-result", "--result-dir", str(tmp_path)))
    # No local tokenizer for the stub's model: the default model's, said so in the result.
    assert result["tokenizer_id"] == DEFAULT_MODEL_NAME
    assert result["completed"] == 3 and result["total_output_tokens"] == 12
    assert set(VLLM_KEYS) | vllm_latency_keys(["ttft", "tpot", "itl"], ["99"]) <= set(result)
    assert not set(VLLM_DETAILED_KEYS) & set(result)  # without --save-detailed
    assert result["request_goodput"] is None  # no --goodput
    for payload in app.state.payloads:
        assert set(payload) <= COMPLETIONS_FIELDS and isinstance(payload["prompt"], str)
    (written,) = tmp_path.iterdir()
    assert written.name == f"lab-100.0qps-concurrency2-stub-model-{result['date']}.json"
    assert json.loads(written.read_text()) == result


def test_vllm_extras_only_when_asked(stub, tokenizer_dir):
    app, url = stub
    # ignore_eos is not OpenAI's: the strict server rejects the test request at once.
    with pytest.raises(BenchServeError, match="Unrecognized request argument.*ignore_eos"):
        main(parse_bench_args("--base-url", url, "--tokenizer", tokenizer_dir,
                              "--num-prompts", "2", "--random-input-len", "5", "--ignore-eos"))
    assert app.state.payloads == []


def test_rejected_or_unreachable_server_is_a_one_line_error(stub, tokenizer_dir):
    _, url = stub
    # The server rejects the test request (an unknown model: 404).
    proc = _run_cli("--base-url", url, "--model", "no-such-model", "--tokenizer",
                    tokenizer_dir, "--num-prompts", "2", "--random-input-len", "5")
    assert proc.returncode != 0
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: the initial test request") and "404" in errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    # Nothing listens (connection refused), so no model list either.
    sock = bound_socket()
    try:
        proc = _run_cli("--port", str(sock.getsockname()[1]), "--num-prompts", "2")
    finally:
        sock.close()
    assert proc.returncode != 0
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and "Connection refused" in errors[0], proc.stderr


def test_vllm_command_line_against_widellm_serve(model_dir, tmp_path):
    from tests.e2e.server_harness import MODEL_ARCH, ServerProcess

    model = model_dir(MODEL_ARCH)
    server = ServerProcess(model, tmp_path / "server.log", ["--served-model-name", "tiny"])
    try:
        server.wait_ready()
        num_prompts, output_len = 8, 6
        proc = _run_cli(
            "--backend", "openai", "--base-url", server.url, "--dataset-name", "random",
            "--random-input-len", "16", "--random-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--max-concurrency", "4", "--tokenizer", model,
            "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--goodput", "tpot:60000", "--save-result", "--save-detailed",
            "--result-filename", str(tmp_path / "widellm.json"))
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr + server.log()
    result = json.loads((tmp_path / "widellm.json").read_text())
    expected = {*VLLM_KEYS, *VLLM_DETAILED_KEYS,
                *vllm_latency_keys(["ttft", "tpot", "itl", "e2el"], ["99"])}
    assert expected <= set(result), expected - set(result)
    assert (result["completed"], result["failed"]) == (num_prompts, 0), result["errors"]
    assert len(result["ttfts"]) == num_prompts and all(t > 0 for t in result["ttfts"])
    assert result["model_id"] == "tiny" and result["tokenizer_id"] == model
    # ignore_eos: every request generated its full output length (the server's usage).
    assert result["output_lens"] == [output_len] * num_prompts
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])


def test_append_result_writes_one_line_per_run(tmp_path):
    from widellm.bench.serve_result import write_result

    path = str(tmp_path / "runs.jsonl")
    write_result(path, {"run": 1}, append=True)
    write_result(path, {"run": 2}, append=True)
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"run": 1}, {"run": 2}]


def test_a_missing_tokenizer_is_a_one_line_error():
    with pytest.raises(BenchServeError, match="cannot load tokenizer '/no/such/tokenizer'"):
        main(parse_bench_args("--model", "m", "--tokenizer", "/no/such/tokenizer",
                              "--num-prompts", "1"))
