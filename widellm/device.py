"""The device widellm's engine computes on.

The model runner, the KV cache and the collectives place everything on the CPU today (a GPU
model runner is a later issue), so engine code asks :func:`on_cuda` rather than
``torch.cuda.is_available()``: the latter is true on any GPU host, whether or not the engine
uses the GPU, and sized the KV pool from GPU memory, chose NCCL for CPU tensors and turned the
CPU kernels off there.
"""

from __future__ import annotations

import torch

ENGINE_DEVICE = torch.device("cpu")


def on_cuda() -> bool:
    """Whether the engine's tensors (weights, KV cache, activations) live on a CUDA device."""
    return ENGINE_DEVICE.type == "cuda"
