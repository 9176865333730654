"""``--device``: on a GPU host ``auto`` still computes on the CPU (the CUDA model runner is not
finished) and ``cuda`` is refused with the reason; nothing may follow
``torch.cuda.is_available()`` past that choice. With torch faked to report a GPU, and every
CUDA memory call failing the test, the KV budget, the KV pool, the engine config and the
collectives come out exactly as on a CPU-only host."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from widellm.device import UNVERIFIED_CUDA_ENV, resolve_device
from widellm.distributed.groups import collective_backend
from widellm.engine import kv_budget
from widellm.engine.arg_utils import EngineArgs
from widellm.worker import kv_cache
from widellm.worker.host_memory import AvailableMemory, ProcFiles, host_available_memory

KIB = 1024
AVAILABLE_KB = 1_000_000  # the fake host's MemAvailable
POOL_BYTES = 256 << 20


def _no_cuda(*args, **kwargs):
    raise AssertionError("the CPU engine called into CUDA")


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """A host with MemAvailable 1,000,000 kB and no memory cgroup."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemAvailable: {AVAILABLE_KB} kB\n")
    (tmp_path / "proc/self/cgroup").write_text("0::/\n")
    (tmp_path / "proc/self/mountinfo").write_text("1 0 0:1 / / rw - ext4 /dev/root rw\n")
    monkeypatch.setattr(kv_cache, "host_available_memory",
                        functools.partial(host_available_memory, ProcFiles(root=tmp_path)))


@pytest.fixture(params=[False, True], ids=["cpu-host", "gpu-host"])
def gpu_host(request, monkeypatch):
    """Both kinds of host; on the GPU one torch reports a device and its memory API fails."""
    if request.param:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        for name in ("mem_get_info", "memory_allocated", "synchronize", "set_device"):
            monkeypatch.setattr(torch.cuda, name, _no_cuda)
    return request.param


@pytest.fixture
def config(model_dir):
    return EngineArgs(model=model_dir("LlamaForCausalLM"), dtype="float32", max_model_len=1024,
                      max_num_seqs=256, kv_cache_memory_fraction=0.5,
                      data_parallel_size=2).create_engine_config()


def test_kv_budget_comes_from_host_memory(gpu_host, fake_host, config):
    assert kv_cache.available_memory() == AvailableMemory(AVAILABLE_KB * KIB, "MemAvailable")
    shared = kv_budget.share_host_memory(config)
    assert shared.cache_config.host_available_memory == AVAILABLE_KB * KIB
    # Two local ranks split 0.5 x 1,024,000,000 bytes; a llama-tiny fp32 block is 16 KiB.
    assert kv_budget.rank_budget_bytes(shared) == 256_000_000
    plan = kv_budget.plan_num_blocks(shared, 16 * KIB)
    assert plan.num_blocks == 256_000_000 // (16 * KIB) == 15625
    assert "256000000-byte budget" in plan.reason


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_kv_pool_is_lazily_mapped_host_memory(gpu_host):
    """A 256 MiB pool costs no resident memory until written (as a CUDA pool, or a
    ``torch.zeros`` one, it would be resident at once)."""
    layer = torch.nn.Module()
    layer.kv_cache_shape = lambda blocks, size: (2, blocks, size, 1024)
    spec = kv_cache.KVCacheSpec((layer,), block_size=16, dtype=torch.float32)
    before = _rss_bytes()
    (cache,) = kv_cache.allocate_kv_cache(spec, num_blocks=2048)
    assert cache.device.type == "cpu" and tuple(cache.shape) == (2, 2048, 16, 1024)
    assert spec.bytes_per_block * 2048 == POOL_BYTES
    assert _rss_bytes() - before < POOL_BYTES // 16
    assert layer.kv_cache is cache and float(cache[:, ::256].abs().sum()) == 0.0


def test_engine_config_and_collectives_are_the_cpu_ones(gpu_host, model_dir):
    config = EngineArgs(model=model_dir("LlamaForCausalLM"), dtype="float32",
                        max_num_batched_tokens=2048).create_engine_config()
    assert config.device == "cpu" and not config.on_cuda
    assert collective_backend(config.device) == "gloo"
    assert collective_backend("cuda") == "nccl"
    sc = config.scheduler_config
    # The CPU defaults: async scheduling (as on a GPU), prefill padded to whole AMX tiles
    # (2,048 tokens over the pad sizes -> 32; a CUDA engine pads nothing).
    assert (sc.async_scheduling, sc.prefill_pad_multiple) == (True, 32)


@pytest.mark.parametrize("visible", [False, True], ids=["cpu-host", "gpu-host"])
def test_device_resolution(visible, monkeypatch):
    assert resolve_device("cpu", cuda_available=visible) == "cpu"
    assert resolve_device("auto", cuda_available=visible) == "cpu"
    reason = "not been verified on a GPU" if visible else "no CUDA device is visible"
    with pytest.raises(ValueError, match=reason):
        resolve_device("cuda", cuda_available=visible)
    # The GPU check's override runs CUDA where a GPU is visible, and only there.
    monkeypatch.setenv(UNVERIFIED_CUDA_ENV, "1")
    if visible:
        assert resolve_device("cuda", cuda_available=visible) == "cuda"
        assert resolve_device("auto", cuda_available=visible) == "cpu"
    else:
        with pytest.raises(ValueError, match="no CUDA device is visible"):
            resolve_device("cuda", cuda_available=visible)
    with pytest.raises(ValueError, match="expected one of"):
        resolve_device("tpu", cuda_available=visible)


def test_device_flag_reaches_the_config(gpu_host, model_dir):
    args = dict(model=model_dir("LlamaForCausalLM"), dtype="float32")
    assert EngineArgs(device="cpu", **args).create_engine_config().device == "cpu"
    with pytest.raises(ValueError, match="device 'cuda'"):
        EngineArgs(device="cuda", **args).create_engine_config()
