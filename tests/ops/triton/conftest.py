"""Triton kernels against their torch twins. Without a CUDA device the kernels run in
Triton's interpreter on CPU tensors: the variable must be set before any kernel module is
imported (``triton.jit`` reads it when it decorates), which a conftest does first. On a GPU
(benchmarks/gpu/check.sh) the same tests run the compiled kernels."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")


@pytest.fixture
def device() -> torch.device:
    """Where the kernels' tensors live: the GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
