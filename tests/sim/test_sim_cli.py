"""``widellm simulate``: flags, config files, and a tiny run end to end."""

from __future__ import annotations

import json

import pytest

from widellm.entrypoints.cli import build_parser, main
from widellm.sim.cli import build_config, build_inputs

TINY = "preset:deepseek-v3-tiny"


def _parse(*flags: str):
    return build_parser().parse_args(["simulate", *flags])


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--num-ranks", "--prefill-ranks", "--decode-ranks",
                 "--all2all-backend", "--enable-dbo", "--enable-eplb", "--eplb-config",
                 "--enforce-eager", "--input-len", "--request-rate", "--concurrency-per-rank",
                 "--prefix-len", "--num-prefix-groups", "--expert-skew", "--output-json",
                 "--plot-dir", "--hardware"):
        assert flag in out, flag


def test_colocated_flags_build_one_pool():
    config = build_config(_parse("--model", TINY, "--num-ranks", "16", "--enable-dbo", "auto",
                                 "--enable-eplb", "--eplb-config",
                                 '{"num_redundant_experts": 16, "window_size": 10}',
                                 "--enforce-eager", "--all2all-backend", "all2all_fixed",
                                 "--no-enable-prefix-caching", "--hardware", "h200"))
    pool = config.colocated
    assert (config.hardware, config.num_gpus, config.disaggregated) == ("h200", 16, False)
    assert (pool.dbo, pool.cuda_graphs, pool.all2all_backend) == ("auto", False, "all2all_fixed")
    assert (pool.eplb.enable_eplb, pool.eplb.num_redundant_experts, pool.eplb.window_size) == \
        (True, 16, 10)
    assert pool.enable_prefix_caching is False


def test_disaggregated_flags_and_per_pool_overrides():
    config = build_config(_parse("--prefill-ranks", "4", "--decode-ranks", "8", "--enable-eplb",
                                 "--decode-config", '{"dbo": "on", "max_num_seqs": 512}'))
    assert (config.prefill.num_ranks, config.decode.num_ranks, config.num_gpus) == (4, 8, 12)
    assert (config.prefill.dbo, config.decode.dbo) == ("off", "on")
    assert (config.prefill.max_num_seqs, config.decode.max_num_seqs) == (256, 512)
    assert config.prefill.eplb.enable_eplb and config.decode.eplb.enable_eplb


@pytest.mark.parametrize("flags, message", [
    (("--prefill-ranks", "4"), "both"),
    (("--num-ranks", "2", "--prefill-ranks", "1", "--decode-ranks", "1"), "colocated"),
    (("--num-ranks", "2", "--decode-config", "{}"), "disaggregated"),
])
def test_bad_deployments_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        build_config(_parse(*flags))


def test_rate_and_concurrency_exclude_each_other():
    with pytest.raises(SystemExit):
        _parse("--request-rate", "4", "--concurrency-per-rank", "2")


def test_config_file_fills_flags_and_flags_win(tmp_path, monkeypatch):
    path = tmp_path / "sim.yaml"
    path.write_text("model: preset:deepseek-v3-tiny\nnum_ranks: 4\ninput-len: uniform:10-20\n"
                    "expert_skew: zipf:1.5\nenable_eplb: true\n"
                    "eplb_config: {num_redundant_experts: 4}\nrequest_rate: 3.5\n")
    seen = {}
    monkeypatch.setattr("widellm.entrypoints.cli.cmd_simulate",
                        lambda args: seen.setdefault("args", args))
    # main() binds cmd_simulate when it builds the parser, so patch before calling it.
    main(["simulate", "--config", str(path), "--num-ranks", "2"])
    args = seen["args"]
    assert (args.model, args.num_ranks, args.input_len) == (TINY, 2, "uniform:10-20")
    assert (args.expert_skew, args.enable_eplb, args.request_rate) == ("zipf:1.5", True, 3.5)
    inputs = build_inputs(args)
    assert inputs.config.colocated.eplb.num_redundant_experts == 4
    assert inputs.workload.input_len.kind == "uniform"
    assert inputs.routing.spec == "zipf:1.5"
    # deepseek-v3-tiny: 16 routed experts, top-4, 2 MoE layers (3 layers, the first dense).
    assert (inputs.routing.num_experts, inputs.routing.top_k, inputs.routing.num_layers) == \
        (16, 4, 2)


def test_config_file_with_an_unknown_flag_is_refused(tmp_path):
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"num_ranks": 2, "no_such_flag": 1}))
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--config", str(path)])
    assert e.value.code == 2


def test_tiny_run_end_to_end(tmp_path, capsys):
    pytest.importorskip("widellm.sim.cluster")
    pytest.importorskip("widellm.sim.cost_model")
    out = tmp_path / "sim.json"
    main(["simulate", "--model", TINY, "--hardware", "h100", "--num-ranks", "2",
          "--num-requests", "6", "--input-len", "32", "--output-len", "4",
          "--request-rate", "100", "--expert-skew", "zipf:1.2", "--max-model-len", "256",
          "--block-size", "16", "--output-json", str(out), "--plot-dir", str(tmp_path / "p")])
    summary = json.loads(out.read_text())
    assert (summary["num_requests"], summary["num_finished"], summary["num_gpus"]) == (6, 6, 2)
    assert (summary["prompt_tokens"], summary["output_tokens"]) == (6 * 32, 6 * 4)
    assert summary["output_throughput_per_gpu"] > 0
    assert summary["workload"]["num_requests"] == 6
    assert summary["routing"]["spec"] == "zipf:1.2"
    assert "colocated" in summary["step_breakdown"]
    table = capsys.readouterr().out
    assert "6 / 6 finished on 2 GPUs" in table
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "balancedness.png", "latency.png", "throughput.png"]


def test_disaggregated_closed_loop_from_a_config_file(tmp_path):
    pytest.importorskip("widellm.sim.cluster")
    config = tmp_path / "sim.yaml"
    config.write_text(f"model: {TINY}\nprefill_ranks: 2\ndecode_ranks: 2\nnum_requests: 8\n"
                      "input_len: 32\noutput_len: 4\nconcurrency_per_rank: 2\n"
                      "max_model_len: 256\nblock_size: 16\n")
    out = tmp_path / "sim.json"
    main(["simulate", "--config", str(config), "--output-json", str(out)])
    summary = json.loads(out.read_text())
    assert (summary["num_requests"], summary["num_finished"], summary["num_gpus"]) == (8, 8, 4)
    assert (summary["prompt_tokens"], summary["output_tokens"]) == (8 * 32, 8 * 4)
    assert sorted(summary["step_breakdown"]) == ["decode", "prefill"]
    assert summary["workload"]["concurrency_per_rank"] == 2
