"""The Ray launcher's placement rules (pure functions: no Ray needed)."""

from __future__ import annotations

import pytest

from widellm.config import ParallelConfig
from widellm.engine.ray_placement import (
    CPUS_PER_RANK_ENV, DEFAULT_CPUS_PER_RANK, cpus_per_rank, forwarded_env, missing_resources,
    place_ranks, rank_bundles,
)


def test_bundles_one_per_rank():
    assert rank_bundles(3, on_gpu=False, cpus=4) == [{"CPU": 4.0}] * 3
    assert rank_bundles(2, on_gpu=True, cpus=4) == [{"GPU": 1.0, "CPU": 1.0}] * 2
    bundles = rank_bundles(2, on_gpu=False, cpus=1)
    bundles[0]["CPU"] = 9.0
    assert bundles[1] == {"CPU": 1.0}  # separate dicts: Ray may annotate them
    with pytest.raises(ValueError):
        rank_bundles(0, on_gpu=False, cpus=1)


def test_cpus_per_rank_from_env():
    assert cpus_per_rank({}) == DEFAULT_CPUS_PER_RANK
    assert cpus_per_rank({CPUS_PER_RANK_ENV: "8"}) == 8
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match=CPUS_PER_RANK_ENV):
            cpus_per_rank({CPUS_PER_RANK_ENV: bad})


def test_missing_resources_names_the_shortfall():
    bundles = rank_bundles(4, on_gpu=True, cpus=1)
    assert missing_resources(bundles, {"GPU": 8.0, "CPU": 64.0}) == {}
    assert missing_resources(bundles, {"GPU": 2.0, "CPU": 64.0}) == {"GPU": (4.0, 2.0)}
    assert missing_resources(bundles, {"CPU": 2.0}) == {"GPU": (4.0, 0.0), "CPU": (4.0, 2.0)}


def test_ranks_consecutive_per_node_frontend_node_first():
    # Bundles 0 and 2 landed on node b, 1 and 3 on the frontend's node a.
    placed = place_ranks(["b", "a", "b", "a"], frontend_node="a")
    assert [(p.rank, p.bundle_index, p.node_id) for p in placed] == [
        (0, 1, "a"), (1, 3, "a"), (2, 0, "b"), (3, 2, "b")]
    assert [(p.node_start_rank, p.node_num_ranks) for p in placed] == [
        (0, 2), (0, 2), (2, 2), (2, 2)]
    # Each rank's node view is a valid config, and every rank counts the same nodes (EPLB).
    for p in placed:
        pc = ParallelConfig(data_parallel_size=4, data_parallel_size_local=p.node_num_ranks,
                            data_parallel_start_rank=p.node_start_rank,
                            data_parallel_backend="ray", enable_expert_parallel=True)
        assert pc.data_parallel_size // pc.local_size == 2


def test_frontend_off_the_cluster_keeps_bundle_order():
    placed = place_ranks(["x", "x", "y", "y"], frontend_node="elsewhere")
    assert [p.bundle_index for p in placed] == [0, 1, 2, 3]
    assert [p.node_start_rank for p in placed] == [0, 0, 2, 2]


def test_uneven_nodes_share_one_view():
    """3 ranks on one node, 1 on another: every rank sees one node of 4 ranks, so EPLB's
    node count agrees on all ranks and each takes the smaller memory share."""
    placed = place_ranks(["a", "a", "b", "a"], frontend_node="a")
    assert [p.bundle_index for p in placed] == [0, 1, 3, 2]
    assert {(p.node_start_rank, p.node_num_ranks) for p in placed} == {(0, 4)}


def test_forwarded_env_by_prefix():
    env = {"WIDELLM_X": "1", "GLOO_SOCKET_IFNAME": "eth0", "PATH": "/bin", "OMP_NUM_THREADS": "8"}
    assert forwarded_env(env, ("WIDELLM_", "GLOO_")) == {
        "WIDELLM_X": "1", "GLOO_SOCKET_IFNAME": "eth0"}


def test_parallel_config_backend():
    assert ParallelConfig().data_parallel_backend == "mp"
    with pytest.raises(ValueError, match="data_parallel_backend"):
        ParallelConfig(data_parallel_backend="slurm")
    # mp ranks on several machines need the head's port; Ray ranks get a free one.
    with pytest.raises(ValueError, match="data_parallel_rpc_port"):
        ParallelConfig(data_parallel_size=2, data_parallel_size_local=1)
    ParallelConfig(data_parallel_size=2, data_parallel_size_local=1, data_parallel_backend="ray")


def test_ray_backend_without_ray_says_how_to_install(monkeypatch):
    """Ray is an optional extra: only the ray backend imports it, and its absence is named."""
    import sys
    from types import SimpleNamespace

    from widellm.engine.core_client import make_ray_launcher

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "widellm.engine.ray_launcher", raising=False)
    assert make_ray_launcher(SimpleNamespace(parallel_config=ParallelConfig())) is None
    config = SimpleNamespace(parallel_config=ParallelConfig(data_parallel_backend="ray"))
    with pytest.raises(ImportError, match=r"widellm\[ray\]"):
        make_ray_launcher(config)


def test_headless_refuses_the_ray_backend(model_dir):
    """A headless node would start mp ranks that the Ray frontend never placed."""
    from widellm.engine.arg_utils import EngineArgs
    from widellm.engine.headless import run_headless

    args = EngineArgs(model=model_dir("LlamaForCausalLM"), data_parallel_size=2,
                      data_parallel_start_rank=1, data_parallel_rpc_port=29999,  # never opened
                      data_parallel_backend="ray")
    with pytest.raises(ValueError, match="run no headless node"):
        run_headless(args)
