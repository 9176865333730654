"""On a GPU host the engine still computes on the CPU: nothing may follow
``torch.cuda.is_available()`` there (KV pool size, collective backend, CPU kernels)."""

from __future__ import annotations

import pytest
import torch

from widellm.device import on_cuda
from widellm.distributed.groups import collective_backend
from widellm.worker import kv_cache


@pytest.fixture
def gpu_host(monkeypatch):
    """torch reports a CUDA device; touching its memory API fails the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def no_cuda_memory(*args, **kwargs):
        raise AssertionError("the CPU engine asked for GPU memory")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_cuda_memory)


def test_cpu_engine_on_a_gpu_host(gpu_host, tmp_path, monkeypatch):
    assert not on_cuda()
    assert collective_backend() == "gloo"
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:   12345 kB\n")
    monkeypatch.setattr(kv_cache, "MEMINFO", str(meminfo))
    assert kv_cache.available_memory_bytes() == 12345 * 1024
