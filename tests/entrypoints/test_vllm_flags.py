"""vLLM's flag shapes on widellm's command line (issue 27): --eplb-config next to the flat
--eplb-* aliases, vLLM's short forms, chunked prefill on and off, the server's logging, CORS
and TLS flags, --config FILE.yaml, ``widellm --version`` and ``python -m widellm``. Parsing
only (and the scheduler without a model); tests/e2e/test_vllm_flags_serve.py runs a server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest

from widellm.config import CacheConfig, EPLBConfig, SchedulerConfig
from widellm.core.scheduler import Scheduler
from widellm.engine.arg_utils import EngineArgs
from widellm.engine.async_llm import AsyncLLM
from widellm.engine.eplb_args import resolve_eplb_config
from widellm.engine.request_logger import RequestLogger
from widellm.entrypoints import cli
from widellm.entrypoints.cli import build_parser, main, package_version
from widellm.entrypoints.config_file import config_file_defaults
from widellm.entrypoints.http_options import check_http_args, cors_options
from widellm.entrypoints.server_args import check_server_args
from widellm.sampling_params import SamplingParams
from tests.core.scheduler_cases import make_request, step

ARGPARSE_ERROR = 2
EPLB_JSON = ('{"window_size": 10, "step_interval": 20, "num_redundant_experts": 2, '
             '"log_balancedness": true}')


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def eplb_of(args: argparse.Namespace | EngineArgs) -> EPLBConfig:
    engine = args if isinstance(args, EngineArgs) else EngineArgs.from_cli_args(args)
    fields = {f: getattr(engine, f) for f in vars(EngineArgs()) if f.startswith("eplb_")}
    defaults = {f: getattr(EngineArgs(), f) for f in fields}
    return resolve_eplb_config(engine.enable_eplb, engine.eplb_config, fields, defaults)


def parse_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(list(argv))
    assert exit_info.value.code == ARGPARSE_ERROR
    return capsys.readouterr().err


# ---- --eplb-config ---------------------------------------------------------------------------

def test_eplb_config_json_sets_vllms_four_keys():
    config = eplb_of(serve_args("--enable-eplb", "--eplb-config", EPLB_JSON))
    assert config == EPLBConfig(enable_eplb=True, window_size=10, step_interval=20,
                                num_redundant_experts=2, log_balancedness=True,
                                min_balancedness_gain=0.05)


def test_flat_eplb_flags_stay_aliases_and_may_agree_with_the_json():
    flat = eplb_of(serve_args("--enable-eplb", "--eplb-window-size", "10",
                              "--eplb-step-interval", "20", "--eplb-num-redundant-experts", "2",
                              "--eplb-log-balancedness"))
    assert flat == eplb_of(serve_args("--enable-eplb", "--eplb-config", EPLB_JSON))
    agreeing = serve_args("--enable-eplb", "--eplb-config", EPLB_JSON, "--eplb-window-size", "10")
    assert eplb_of(agreeing) == flat


def test_flat_flag_contradicting_the_json_is_an_error():
    args = serve_args("--enable-eplb", "--eplb-config", '{"window_size": 10}',
                      "--eplb-window-size", "11")
    with pytest.raises(ValueError, match=r"window_size=10 contradicts --eplb-window-size 11"):
        eplb_of(args)


def test_eplb_config_unknown_key_or_wrong_kind_is_argparses_error(capsys):
    err = parse_error(capsys, "serve", "--eplb-config", '{"window_size": 5, "use_async": true}')
    assert "argument --eplb-config: eplb_config: unknown keys ['use_async']" in err
    err = parse_error(capsys, "serve", "--eplb-config", '{"window_size": true}')
    assert "window_size must be a JSON int, got True" in err
    err = parse_error(capsys, "serve", "--eplb-config", "{window_size: 5}")
    assert "eplb_config: not valid JSON" in err


def test_llm_kwarg_eplb_config_takes_a_dict():
    config = eplb_of(EngineArgs(enable_eplb=True, eplb_config={"step_interval": 40,
                                                               "min_balancedness_gain": 0.0}))
    assert (config.step_interval, config.min_balancedness_gain, config.window_size) == \
        (40, 0.0, 1000)
    with pytest.raises(ValueError, match=r"unknown keys \['policy'\]"):
        eplb_of(EngineArgs(eplb_config={"policy": "default"}))


def test_create_engine_config_carries_the_eplb_config():
    config = EngineArgs(model="preset:deepseek-v3-tiny", data_parallel_size=2,
                        enable_expert_parallel=True, enable_eplb=True,
                        eplb_config=EPLB_JSON).create_engine_config()
    assert (config.eplb_config.window_size, config.eplb_config.num_redundant_experts) == (10, 2)


# ---- short forms and aliases -----------------------------------------------------------------

def test_vllms_short_parallel_flags():
    args = serve_args("-dp", "4", "-dpl", "2", "-dpr", "2", "-dpa", "10.0.0.1", "-dpp", "5555",
                      "-ep", "--headless")
    engine = EngineArgs.from_cli_args(args)
    assert (engine.data_parallel_size, engine.data_parallel_size_local,
            engine.data_parallel_start_rank, engine.data_parallel_address,
            engine.data_parallel_rpc_port, engine.enable_expert_parallel) == \
        (4, 2, 2, "10.0.0.1", 5555, True)
    assert serve_args("--num-gpu-blocks-override", "64").num_kv_blocks == 64


def test_flags_of_features_widellm_lacks_stay_unknown(capsys):
    for flag in ("--tensor-parallel-size", "-tp", "--gpu-memory-utilization",
                 "--quantization", "--trust-remote-code"):
        err = parse_error(capsys, "serve", flag, "2")
        assert "unrecognized arguments" in err, flag


def test_unknown_flag_exits_2_through_main(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--tensor-parallel-size", "2"])
    assert exit_info.value.code == ARGPARSE_ERROR
    assert "unrecognized arguments: --tensor-parallel-size" in capsys.readouterr().err


# ---- chunked prefill -------------------------------------------------------------------------

def test_chunked_prefill_flag_parses_both_ways():
    assert serve_args().enable_chunked_prefill is True
    assert serve_args("--enable-chunked-prefill").enable_chunked_prefill is True
    assert serve_args("--no-enable-chunked-prefill").enable_chunked_prefill is False


def test_without_chunked_prefill_the_budget_must_hold_a_whole_prompt():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(2048\) must be >= "
                                         r"max_model_len \(4096\)"):
        SchedulerConfig(max_num_batched_tokens=2048, max_model_len=4096,
                        enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="without chunked prefill"):
        EngineArgs(model="preset:deepseek-v3-tiny", max_model_len=512,
                   max_num_batched_tokens=256,
                   enable_chunked_prefill=False).create_engine_config()


@pytest.mark.parametrize("chunked, first, second",
                         [(True, {"a": 10, "b": 6}, {"a": 1, "b": 4}),
                          (False, {"a": 10}, {"a": 1, "b": 10})])
def test_scheduler_chunks_a_prompt_only_with_chunked_prefill(chunked, first, second):
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_model_len=16,
                                      enable_chunked_prefill=chunked),
                      CacheConfig(block_size=4), 64)
    sched.add_request(make_request("a", [10] * 10))
    sched.add_request(make_request("b", [20] * 10))
    assert step(sched)[0].num_scheduled_tokens == first
    assert step(sched)[0].num_scheduled_tokens == second


# ---- logging ---------------------------------------------------------------------------------

def _output_loop_maybe_logs(log_stats: bool) -> MagicMock:
    """Run AsyncLLM's output loop over one batch (with scheduler stats) on fakes; the
    metrics mock records what the loop called."""
    engine = AsyncLLM.__new__(AsyncLLM)
    batch = SimpleNamespace(engine_error=None, dp_rank=0, scheduler_stats=object(),
                            eplb_stats=None, step_breakdown=None, timestamp=0.0, outputs=[])
    batches = iter([batch])

    async def get_output_async(_timeout):
        try:
            return next(batches)
        except StopIteration:
            raise asyncio.CancelledError from None

    engine.client = SimpleNamespace(get_output_async=get_output_async, is_alive=lambda: True)
    engine.stall_detector = MagicMock()
    engine.metrics = MagicMock()
    engine.output_processor = MagicMock()
    engine.output_processor.process_outputs.return_value = ([], [])
    engine._queues = {}
    engine.log_stats = log_stats
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(engine._output_loop())
    return engine.metrics


def test_disable_log_stats_drops_the_log_line_but_keeps_the_metrics():
    assert serve_args().disable_log_stats is False
    assert serve_args("--disable-log-stats").disable_log_stats is True
    on, off = _output_loop_maybe_logs(True), _output_loop_maybe_logs(False)
    assert on.maybe_log.call_count == 1 and off.maybe_log.call_count == 0
    assert on.record_scheduler_stats.call_count == off.record_scheduler_stats.call_count == 1


def test_request_logger_logs_id_params_length_and_a_cut_prompt(caplog):
    params = SamplingParams(max_tokens=3)
    with caplog.at_level(logging.INFO, logger="widellm.engine.request_logger"):
        RequestLogger(max_log_len=5).log_request("cmpl-1", "Hello world", [1, 2, 3], params)
        RequestLogger().log_request("cmpl-2", None, [7, 8, 9], params)
    first, second = caplog.messages
    assert first == f"received request cmpl-1: 3 prompt tokens, params: {params}, " \
                    f"prompt: 'Hello'"
    assert second.endswith("prompt: [7, 8, 9]") and "cmpl-2: 3 prompt tokens" in second


def test_max_log_len_needs_enable_log_requests():
    with pytest.raises(ValueError, match="--max-log-len needs --enable-log-requests"):
        check_server_args(serve_args("--max-log-len", "10"))
    check_server_args(serve_args("--max-log-len", "10", "--enable-log-requests"))


# ---- CORS and TLS ----------------------------------------------------------------------------

def test_cors_is_off_by_default_and_takes_json_lists():
    assert cors_options(serve_args()) is None
    assert cors_options(serve_args("--allowed-origins", '["https://a.example"]',
                                   "--allowed-methods", '["GET", "POST"]',
                                   "--allow-credentials")) == dict(
        allow_origins=["https://a.example"], allow_methods=["GET", "POST"],
        allow_headers=["*"], allow_credentials=True)


def test_cors_and_tls_modifiers_alone_are_errors(capsys, tmp_path):
    err = parse_error(capsys, "serve", "--allowed-origins", "https://a.example")
    assert "argument --allowed-origins: not valid JSON" in err
    with pytest.raises(ValueError, match="--allowed-headers needs --allowed-origins"):
        check_http_args(serve_args("--allowed-headers", '["X-A"]'))
    with pytest.raises(ValueError, match="--ssl-keyfile needs --ssl-certfile"):
        check_http_args(serve_args("--ssl-keyfile", "k.pem"))
    with pytest.raises(ValueError, match="--ssl-cert-reqs needs --ssl-certfile"):
        check_http_args(serve_args("--ssl-cert-reqs", "2"))
    with pytest.raises(ValueError, match="--root-path must start with '/'"):
        check_http_args(serve_args("--root-path", "prefix"))
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="cannot load"):
        check_http_args(serve_args("--ssl-certfile", missing))


# ---- --config FILE.yaml ----------------------------------------------------------------------

def _write(tmp_path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_values_yield_to_the_command_line(tmp_path, monkeypatch):
    path = _write(tmp_path, "model: preset:deepseek-v3-tiny\nmax-num-seqs: 8\nmax_n: 3\n"
                            "enable-prefix-caching: false\nallowed-origins: ['*']\n"
                            "eplb_config: {window_size: 12}\nserved-model-name: [a, b]\n"
                            "api-key: -starts-with-a-dash\ndisable-log-stats: true\n")
    seen = {}
    real_build = cli.build_parsers

    def recording_parsers(only=None):
        parser, serve = real_build(only)
        serve.set_defaults(func=lambda args: seen.update(vars(args)))  # instead of serving
        return parser, serve

    monkeypatch.setattr(cli, "build_parsers", recording_parsers)
    main(["serve", "--config", path, "--max-num-seqs", "16", "--port", "9"])
    assert (seen["model"], seen["max_num_seqs"], seen["max_n"], seen["port"]) == \
        ("preset:deepseek-v3-tiny", 16, 3, 9)
    assert seen["enable_prefix_caching"] is False and seen["disable_log_stats"] is True
    assert seen["allowed_origins"] == ["*"] and seen["eplb_config"] == {"window_size": 12}
    assert seen["served_model_name"] == ["a", "b"]
    assert seen["api_key"] == "-starts-with-a-dash"
    seen.clear()
    main(["serve", "other-model", "--config", path])
    assert seen["model"] == "other-model" and seen["max_num_seqs"] == 8


@pytest.mark.parametrize("text, message", [
    ("tensor-parallel-size: 2\n", "unknown flag 'tensor-parallel-size'"),
    ("config: other.yaml\n", "unknown flag 'config'"),
    ("- a list\n", "must be a YAML mapping"),
    ("enable-log-requests: 1\n", "true or false in the config file, got 1"),
])
def test_config_file_errors(tmp_path, text, message):
    serve = cli.build_parsers()[1]
    with pytest.raises(ValueError, match=message):
        config_file_defaults(serve, _write(tmp_path, text))


def test_bad_config_file_is_argparses_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--config", _write(tmp_path, "max-num-seqs: many\n")])
    assert exit_info.value.code == ARGPARSE_ERROR
    assert "argument --max-num-seqs: invalid int value: 'many'" in capsys.readouterr().err


# ---- --version and python -m widellm ---------------------------------------------------------

def test_version_and_python_dash_m():
    import importlib.metadata

    assert package_version() == importlib.metadata.version("widellm")
    version = subprocess.run([sys.executable, "-m", "widellm", "--version"],
                             capture_output=True, text=True, timeout=120)
    assert (version.returncode, version.stdout) == (0, package_version() + "\n")
    helped = subprocess.run([sys.executable, "-m", "widellm", "serve", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "usage: widellm serve" in helped.stdout
    assert "--eplb-config" in helped.stdout and "-dp DATA_PARALLEL_SIZE" in helped.stdout
    unknown = subprocess.run([sys.executable, "-m", "widellm", "serve",
                              "--tensor-parallel-size", "2"],
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == ARGPARSE_ERROR


# ---- the app's docs under --disable-fastapi-docs and --root-path ------------------------------

@pytest.mark.parametrize("argv, status, servers", [
    ([], 200, None),
    (["--disable-fastapi-docs"], 404, None),
    (["--api-key", "k", "--root-path", "/p"], 200, [{"url": "/p"}]),  # the guarded schema
    (["--api-key", "k", "--disable-fastapi-docs"], 404, None),
])
def test_docs_flags_on_the_app(argv, status, servers):
    import httpx

    from widellm.entrypoints.api_server import build_app

    engine = MagicMock()  # build_app only reads names and paths from it here
    engine.model_config.served_names = ["m"]
    app = build_app(engine, serve_args("--generation-config", "vllm", *argv))

    async def get(path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            return await client.get(path, headers={"Authorization": "Bearer k"})

    for path in ("/openapi.json", "/docs"):
        assert asyncio.run(get(path)).status_code == status, path
    if status == 200:
        assert asyncio.run(get("/openapi.json")).json().get("servers") == servers


# ---- --return-tokens-as-token-ids --------------------------------------------------------------

@pytest.mark.parametrize("argv, request_asks, expected", [
    ([], None, False), ([], True, True),
    (["--return-tokens-as-token-ids"], None, True),
    (["--return-tokens-as-token-ids"], False, True),  # the flag names tokens in every answer
])
def test_return_tokens_as_token_ids_flag_or_request(argv, request_asks, expected):
    from widellm.entrypoints.api_server import serving_options
    from widellm.entrypoints.protocol import CompletionRequest
    from widellm.entrypoints.serving_base import OpenAIServing

    engine = MagicMock()
    options = serving_options(engine, serve_args("--generation-config", "vllm", *argv))
    serving = OpenAIServing(engine, ["m"], 1, executor=MagicMock(), **options)
    request = CompletionRequest(prompt="x", return_tokens_as_token_ids=request_asks)
    assert serving.tokens_as_ids(request) is expected
