"""Checkpoint formats: sharded safetensors with an index load like a single file; unknown
architectures and paths are refused with errors naming the model."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from widellm import LLM, SamplingParams
from widellm.model.loader import SAFETENSORS_INDEX, iterate_weights, resolve_model_path

NUM_SHARDS = 3


def shard_checkpoint(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` with its tensors split over NUM_SHARDS files plus an index."""
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "model.safetensors"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i in range(NUM_SHARDS):
        fname = f"model-{i + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::NUM_SHARDS]}
        save_file(part, os.path.join(dst, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(dst, SAFETENSORS_INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def test_sharded_checkpoint_matches_single_file(model_dir, tmp_path):
    single = model_dir("Qwen3MoeForCausalLM")
    sharded = str(tmp_path / "sharded")
    shard_checkpoint(single, sharded)
    a = dict(iterate_weights(single))
    b = dict(iterate_weights(sharded))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    prompt = list(range(20, 60))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [LLM(p, dtype="float32", num_kv_blocks=256).generate([prompt], params, use_tqdm=False)
            for p in (single, sharded)]
    assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids


def test_unsupported_architecture_is_named(model_dir, tmp_path):
    path = str(tmp_path / "odd")
    shutil.copytree(model_dir("LlamaForCausalLM"), path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["NoSuchForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="NoSuchForCausalLM"):
        LLM(path, dtype="float32", num_kv_blocks=256)


def test_missing_tensor_is_reported(model_dir, tmp_path):
    path = str(tmp_path / "partial")
    shutil.copytree(model_dir("LlamaForCausalLM"), path)
    st = os.path.join(path, "model.safetensors")
    tensors = load_file(st)
    del tensors["model.norm.weight"]
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        LLM(path, dtype="float32", num_kv_blocks=256)


def test_resolve_model_path_errors_name_the_model():
    with pytest.raises(ValueError, match="/nowhere"):
        resolve_model_path("/nowhere")
