"""The device widellm's engine computes on: ``--device auto|cpu|cuda``, resolved once into
``EngineConfig.device`` ("cpu" or "cuda"), which every part that places tensors or picks a
collective backend reads (the loader, the KV pool and its budget, the model runner's
generator, the step timer, the process groups). Engine code asks the config, never
``torch.cuda.is_available()``: that is true on any GPU host, whether or not the engine uses the
GPU, and once sized the KV pool from GPU memory, chose NCCL for CPU tensors and turned the CPU
kernels off there.

CUDA is refused for now: the pieces exist (Triton kernels, the attention backend, FP8 linears,
graph buckets) but the model runner still builds its step inputs on the host and has never run
on a GPU (``benchmarks/gpu/check.sh`` is the check that would admit it). ``auto`` therefore
resolves to the CPU on GPU hosts too, with a log line saying so.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
# Whether the CUDA model runner is finished and verified on a GPU (see the module docstring).
CUDA_RUNNER_READY = False


def resolve_device(name: str, cuda_available: bool | None = None) -> str:
    """``--device`` -> "cpu" or "cuda".

    Args:
        name: one of :data:`DEVICES`.
        cuda_available: whether a GPU is visible (None: ask torch).

    Raises:
        ValueError: an unknown name, or "cuda" where it cannot run (no GPU visible, or the CUDA
            model runner not finished).
    """
    if name not in DEVICES:
        raise ValueError(f"device {name!r}: expected one of {DEVICES}")
    if name == "cpu":
        return "cpu"
    visible = torch.cuda.is_available() if cuda_available is None else cuda_available
    if name == "cuda" and not visible:
        raise ValueError("device 'cuda': no CUDA device is visible")
    if name == "cuda" and not CUDA_RUNNER_READY:
        raise ValueError("device 'cuda': widellm's CUDA model runner is not finished yet (its "
                         "step inputs are built on the host); use --device cpu")
    if visible and CUDA_RUNNER_READY:
        return "cuda"
    if visible:
        logger.info("a CUDA device is visible, but the engine runs on the CPU (the CUDA model "
                    "runner is not finished yet)")
    return "cpu"
