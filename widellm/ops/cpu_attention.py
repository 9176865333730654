"""Paged decode attention on CPUs: a C++ kernel that reads K/V in place from the paged cache,
and its torch reference twin (gather the context, then plain softmax attention).

The gather-then-attend path copies every sequence's whole context out of the cache each layer
and step, then reads it again; at batch 64 that is most of a small model's decode time. The
kernel reads each cached row once. It is compiled on first use with torch's C++ extension
builder (ninja + the system C++ compiler, ~30 s once per machine, cached by torch) for the
CPU it runs on. Where that is impossible, or with ``WIDELLM_CPU_KERNELS=0``, callers get
``None`` from :func:`load_cpu_kernels` and use the reference path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "paged_attention.cpp"
ENV_DISABLE = "WIDELLM_CPU_KERNELS"
# -march=native: AVX-512 intrinsics where this CPU has them, plain loops otherwise.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def _cpu_tag() -> str:
    """Short hash of this CPU's feature flags: a build for one CPU is never loaded on another
    (torch caches extensions by name and source, not by machine)."""
    try:
        flags = next(
            (ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")),
            "",
        )
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    """The compiled module (built on first call, then cached per process), or None when
    disabled or the build fails (logged once)."""
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        module = load(
            name=f"widellm_cpu_attention_{_cpu_tag()}",
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        logger.info("CPU attention kernels ready (%.1f s)", time.perf_counter() - start)
        return module
    except Exception as exc:  # no compiler, no ninja, unsupported platform
        logger.warning("CPU attention kernels unavailable (%s); using the torch reference path",
                       exc)
        return None


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q [B, Hkv, G, Dk]; k_cache [num_blocks, block_size, Hkv, Dk] and v_cache
    [num_blocks, block_size, Hkv, Dv] (last dim contiguous; V may view K's storage);
    block_table [B, max_blocks] int64; seq_lens [B] int64 -> [B, Hkv, G, Dv] in q's dtype.
    Requires :func:`load_cpu_kernels` to have returned a module."""
    kernels = load_cpu_kernels()
    if kernels is None:
        raise RuntimeError("CPU attention kernels are not available")
    return kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, block_table,
                                          seq_lens, scale)


def paged_decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Same contract as :func:`paged_decode_attention`, in plain torch: gather each sequence's
    context, then masked softmax attention in fp32 (fp64 for fp64 inputs: a ground truth for
    tests)."""
    B, Hkv, G, _ = q.shape
    block_size = k_cache.shape[1]
    L = int(seq_lens.max()) if B else 0
    pos = torch.arange(L)
    blocks = block_table[:, (pos // block_size).clamp(max=block_table.shape[1] - 1)]  # [B, L]
    k = k_cache[blocks, pos % block_size]  # [B, L, Hkv, Dk]
    v = v_cache[blocks, pos % block_size]  # [B, L, Hkv, Dv]
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bhgd,blhd->bhgl", q.to(acc), k.to(acc)) * scale
    valid = pos[None, :] < seq_lens[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Rows past a sequence's end hold whatever the padding blocks hold: zero them, since a
    # zero probability times a non-finite value would still poison the sum.
    v = v.to(acc).masked_fill(~valid[:, :, None, None], 0.0)
    return torch.einsum("bhgl,blhd->bhgd", probs, v).to(q.dtype)
