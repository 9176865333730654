"""Offline EPLB's recorded load file and settings: the file round-trips exactly, a wrong file
is refused naming what is wrong, and the ``--eplb-config`` keys are checked before the model
loads (a missing file, a missing directory, the keys without ``--enable-eplb``)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from widellm.config import EPLBConfig
from widellm.eplb.load_file import load_expert_load, save_expert_load
from widellm.entrypoints.cli import build_parser
from widellm.engine.arg_utils import EngineArgs
from widellm.engine.eplb_args import resolve_eplb_config


def _eplb(args: EngineArgs) -> EPLBConfig:
    flat = {f: getattr(args, f) for f in vars(EngineArgs()) if f.startswith("eplb_")}
    defaults = {f: getattr(EngineArgs(), f) for f in flat}
    return resolve_eplb_config(args.enable_eplb, args.eplb_config, flat, defaults)


def test_round_trip_is_exact_and_leaves_no_temporary_file(tmp_path):
    load = torch.tensor([[10, 0, 3, 3], [1, 1, 1, 13]])
    path = str(tmp_path / "load.json")
    save_expert_load(path, load, top_k=2, num_steps=16)
    assert load_expert_load(path, 2, 4).tolist() == [[10, 0, 3, 3], [1, 1, 1, 13]]
    with open(path) as f:
        doc = json.load(f)
    assert (doc["format"], doc["num_experts"], doc["top_k"], doc["num_steps"],
            doc["num_tokens"]) == ("widellm.routing_counts.v1", 4, 2, 16, [8, 8])
    assert os.listdir(tmp_path) == ["load.json"]
    save_expert_load(path, load + 1, top_k=2, num_steps=32)  # rewritten in place
    assert load_expert_load(path, 2, 4).tolist() == [[11, 1, 4, 4], [2, 2, 2, 14]]


def _write(tmp_path, doc) -> str:
    path = str(tmp_path / "bad.json")
    with open(path, "wb") as f:
        f.write(doc.encode("latin-1") if isinstance(doc, str) else json.dumps(doc).encode())
    return path


GOOD = {"format": "widellm.routing_counts.v1", "counts": [[1, 2]]}


@pytest.mark.parametrize("doc,message", [
    ("{not json", "cannot read it"),
    ("\x80\x02torch", "is not JSON"),
    ({**GOOD, "format": "sglang"}, "is not a widellm.routing_counts.v1 file"),
    ([[1, 2]], "is not a widellm.routing_counts.v1 file"),
    ({**GOOD, "counts": [[1, 2, 3]]}, r"holds \(1, 3\) \(MoE layers, experts\); this model "
                                      r"has \(1, 2\)"),
    ({**GOOD, "counts": [[1.5, 2]]}, "'counts' is not a table of integers"),
    ({**GOOD, "counts": [[1], [2, 3]]}, "'counts' is not a table of integers"),
    ({**GOOD, "counts": [[1, -2]]}, "counts must be >= 0"),
])
def test_a_wrong_file_is_refused_naming_why(tmp_path, doc, message):
    with pytest.raises(ValueError, match=message):
        load_expert_load(_write(tmp_path, doc), 1, 2)


def test_settings_are_checked_before_the_model_loads(tmp_path):
    path = _write(tmp_path, GOOD)
    config = _eplb(EngineArgs(enable_eplb=True, eplb_config={
        "load_path": path, "save_path": str(tmp_path / "next.json"), "static": True}))
    assert (config.load_path, config.save_path, config.static) == (
        path, str(tmp_path / "next.json"), True)
    with pytest.raises(ValueError, match="is not a file"):
        EPLBConfig(enable_eplb=True, load_path=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="does not exist"):
        EPLBConfig(enable_eplb=True, save_path=str(tmp_path / "no_dir" / "load.json"))
    with pytest.raises(ValueError, match="need --enable-eplb"):
        _eplb(EngineArgs(eplb_config={"static": True}))


def test_cli_refuses_wrong_kinds(capsys):
    parser = build_parser()
    for value, message in (('{"static": 1}', "static must be a JSON bool, got 1"),
                           ('{"load_path": ""}', "load_path must be a JSON str, got ''")):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--eplb-config", value])
        assert message in capsys.readouterr().err


def test_the_simulator_refuses_the_file_keys(tmp_path):
    """It prices one MoE layer standing for all: a per-layer file is the engine's."""
    from widellm.sim.config import PoolConfig

    with pytest.raises(ValueError, match="the simulator does not read or write"):
        PoolConfig(num_ranks=2, eplb=EPLBConfig(enable_eplb=True,
                                                save_path=str(tmp_path / "load.json")))
    assert PoolConfig(num_ranks=2, eplb=EPLBConfig(enable_eplb=True, static=True)).eplb.static


def test_one_format_for_the_engine_and_the_simulator(tmp_path):
    """A deployment's saved load replays in ``widellm simulate --expert-skew recorded:FILE``,
    and ``benchmarks/record_routing.py``'s output (which adds the model's name) places a
    deployment's experts."""
    from widellm.sim.routing import ExpertRouting

    path = str(tmp_path / "load.json")
    save_expert_load(path, torch.tensor([[6, 2, 2, 2], [3, 3, 3, 3]]), top_k=2, num_steps=3)
    routing = ExpertRouting.recorded(path, num_experts=4, top_k=2, num_layers=2)
    assert routing.inclusion.flatten().tolist() == pytest.approx([1.0] + [1 / 3] * 3 + [0.5] * 4)
    recorded = {"format": "widellm.routing_counts.v1", "model": "preset:x", "num_experts": 2,
                "top_k": 1, "num_tokens": [3], "counts": [[1, 2]]}
    assert load_expert_load(_write(tmp_path, recorded), 1, 2).tolist() == [[1, 2]]
