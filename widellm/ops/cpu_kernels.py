"""widellm's C++ CPU kernels (``cpu/``): paged decode attention, causal prefill attention, fused
SiLU-and-mul, RMSNorm (alone and with the residual add), rotary embedding, MLA decode attention
and the routed experts, each with a torch reference twin where it is used.

They are compiled on first use with torch's C++ extension builder (ninja + the system C++
compiler, once per machine and kernel source, then cached by torch; 1.5-2.3 minutes on a
2-core AVX2 VM) for the CPU they run on, into ``<torch extensions root>/py<ver>_torch<ver>/
widellm_cpu_ops_<tag>``: the tag hashes the CPU's flags, the compiler flags, the sources and
their folder, so two checkouts, versions or targets never share (and keep rebuilding) one
folder. A build holds an ``flock`` beside its folder, which the kernel drops if the process
dies; so a ``lock`` file torch's builder finds there can only be left by a build killed
part-way (Ctrl-C, the OOM killer), and is removed instead of being waited on forever. Where that is impossible, or with ``WIDELLM_CPU_KERNELS=0``,
:func:`load_cpu_kernels` returns None and every caller takes its torch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("cpu")
SOURCES = (
    "bindings.cpp", "paged_attention.cpp", "paged_attention_bf16.cpp", "elementwise.cpp",
    "mla_decode.cpp", "prefill_attention.cpp", "prefill_attention_bf16.cpp",
    "prefill_attention_fp32.cpp", "moe.cpp", "decoder_layers.cpp", "kv_store.cpp",
)
ENV_DISABLE = "WIDELLM_CPU_KERNELS"
# The -march the kernels are built for. native: AVX-512 (and AMX) intrinsics where this CPU has
# them, AVX2 where that is the best it has, plain loops otherwise. Another target builds the
# paths of another CPU kind, e.g. WIDELLM_CPU_MARCH=x86-64-v3 runs the AVX2 paths (those of AMD
# Zen 1-3) on an AVX-512 machine, to test or time them there.
ENV_MARCH = "WIDELLM_CPU_MARCH"
DEFAULT_MARCH = "native"
# The file torch's extension builder creates in a build folder while it builds and waits on
# while it exists (torch.utils.file_baton).
TORCH_BUILD_LOCK = "lock"
TORCH_EXTENSIONS_DIR_ENV = "TORCH_EXTENSIONS_DIR"


def cflags() -> list[str]:
    return ["-O3", f"-march={os.environ.get(ENV_MARCH, DEFAULT_MARCH)}", "-fopenmp"]


def _build_tag() -> str:
    """Short hash of this CPU's feature flags, the compiler flags and every file in ``cpu/``:
    torch caches an extension by name and the listed sources, so without it a build for
    another CPU or target, or one made before a header changed, could be loaded."""
    try:
        flags = next(
            (ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")),
            "",
        )
    except OSError:
        flags = ""
    digest = hashlib.sha1(flags.encode())
    digest.update(" ".join(cflags()).encode())
    digest.update(str(SOURCE_DIR.resolve()).encode())
    for path in sorted(SOURCE_DIR.iterdir()):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def build_directory(name: str) -> Path:
    """Where the build ``name`` lives: torch's root, or TORCH_EXTENSIONS_DIR as torch's
    builder itself honours it."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get(TORCH_EXTENSIONS_DIR_ENV) or get_default_build_root()
    version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return Path(root) / version / name


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold the build folder against other widellm processes, removing a stale torch lock."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.with_name(build_dir.name + ".widellm-lock"), "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is building the CPU kernels in %s; waiting", build_dir)
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / TORCH_BUILD_LOCK
        if stale.exists():  # no live build holds our flock, so nobody is behind this file
            logger.warning("removing %s, left by a CPU kernel build killed part-way", stale)
            stale.unlink(missing_ok=True)
        yield


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    """The compiled module (built on first call, then cached per process), or None when
    disabled or the build fails (logged once)."""
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        name = f"widellm_cpu_ops_{_build_tag()}"
        build_dir = build_directory(name)
        start = time.perf_counter()
        with exclusive_build(build_dir):
            cached = (build_dir / f"{name}.so").exists()
            if not cached:
                logger.info("compiling the CPU kernels for this CPU into %s (once per machine "
                            "and source; a few minutes on 2 cores)", build_dir)
            module = load(
                name=name,
                sources=[str(SOURCE_DIR / source) for source in SOURCES],
                extra_cflags=cflags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
        logger.info("CPU kernels ready (%.1f s, %s %s)", time.perf_counter() - start,
                    "cached in" if cached else "compiled into", build_dir)
        return module
    except Exception as exc:  # no compiler, no ninja, unsupported platform
        logger.warning("CPU kernels unavailable (%s); using the torch reference paths", exc)
        return None


# The dtypes the elementwise kernels (norms, rotary, SiLU-and-mul) take. fp32 is among them:
# it is the serving dtype of CPUs without native bf16, where a decode step's ~35 small torch
# ops per layer cost more than the kernels' one pass each. Its results are within fp32
# rounding of the torch reference (not bit-equal: another order of a sum, a polynomial exp).
ELEMENTWISE_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def elementwise_kernels(x: torch.Tensor) -> ModuleType | None:
    """The kernels for an elementwise op on ``x``, or None for the torch reference path: CPU
    tensors of :data:`ELEMENTWISE_KERNEL_DTYPES`, where the kernels are built."""
    if x.device.type != "cpu" or x.dtype not in ELEMENTWISE_KERNEL_DTYPES:
        return None
    return load_cpu_kernels()
