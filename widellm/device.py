"""The device widellm's engine computes on: ``--device auto|cpu|cuda``, resolved once into
``EngineConfig.device`` ("cpu" or "cuda"), which every part that places tensors or picks a
collective backend reads (the loader, the KV pool and its budget, the model runner's
generator, the step timer, the process groups). Engine code asks the config, never
``torch.cuda.is_available()``: that is true on any GPU host, whether or not the engine uses the
GPU, and once sized the KV pool from GPU memory, chose NCCL for CPU tensors and turned the CPU
kernels off there.

CUDA is refused for now: the pieces exist (Triton kernels, the attention backend, FP8 linears
and experts, decode graphs over persistent step buffers) but the CUDA engine has never run on a
GPU. ``benchmarks/gpu/check.sh`` is the check that would admit it: it sets
``WIDELLM_UNVERIFIED_CUDA=1``, which lets ``--device cuda`` run so the check can compare it with
the CPU engine. ``auto`` resolves to the CPU on GPU hosts, with a log line saying so.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
# Whether the CUDA model runner is finished and verified on a GPU (see the module docstring).
CUDA_RUNNER_READY = False
# "1": run --device cuda although it is not verified yet (the GPU check sets it).
UNVERIFIED_CUDA_ENV = "WIDELLM_UNVERIFIED_CUDA"


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
    if name == "cuda" and not (CUDA_RUNNER_READY or os.environ.get(UNVERIFIED_CUDA_ENV) == "1"):
        raise ValueError("device 'cuda': widellm's CUDA engine has not been verified on a GPU "
                         f"yet (benchmarks/gpu/check.sh; {UNVERIFIED_CUDA_ENV}=1 runs it "
                         "anyway); use --device cpu")
    if name == "cuda":
        return "cuda"
    if visible and CUDA_RUNNER_READY:
        return "cuda"
    if visible:
        logger.info("a CUDA device is visible, but the engine runs on the CPU (the CUDA model "
                    "runner is not finished yet)")
    return "cpu"
