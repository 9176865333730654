"""Triton kernels against their torch twins. Without a CUDA device the kernels run in
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by tests/conftest.py before
anything imports triton). On a GPU (benchmarks/gpu/check.sh) the same tests run the compiled
kernels."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture
def device() -> torch.device:
    """Where the kernels' tensors live: the GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
