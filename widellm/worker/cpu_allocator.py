"""Keep freed memory in the process on CPU.

Each step allocates tens of MB of activations (MoE dispatch buffers, norms in fp32). glibc
serves blocks that large with fresh mmap()s and returns them on free, so every step pays page
faults and kernel zeroing on all of it again; measured here, that was ~30% of a 4,096-token
prefill step. Turning off mmap for allocations and never trimming the heap lets freed blocks
be reused (vLLM's CPU backend gets the same effect by preloading tcmalloc). The cost is that
the resident size stays at its peak, which is the number benchmarks report anyway.

One arena for every thread: glibc gives each new thread that allocates its own arena, whose
heaps are 64 MiB mmap()s that it unmaps again when they empty, so a forward on the async
runner thread, a DBO micro-batch thread or a KV transfer thread got none of the reuse above
(measured: the async runner's decode steps 15-30% slower than the same steps on the main
thread). The threads that allocate large blocks take turns anyway, so one arena costs no
contention that matters. The arena limit only binds threads that have not allocated yet, so
the engine sets it first thing (:func:`use_one_arena`), before it starts any thread; the
heap settings follow once the weights and KV cache are in place (:func:`keep_freed_memory`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
# Trim only above this much free heap (the largest value mallopt's int takes): never, in
# practice.
NEVER_TRIM_BYTES = 2**31 - 1


def _mallopt():
    """glibc's ``mallopt``, or None where glibc is not the allocator."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None)
    if mallopt is not None:
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt


def use_one_arena() -> bool:
    """Make threads that start allocating from now on share the main arena; False where
    glibc is not the allocator. Call it before the process starts the threads that will run
    forwards (before its first thread, where possible): a thread that has allocated keeps
    its arena, and a new thread takes an exited thread's arena before the limit is looked at
    (measured: an async runner thread started before the limit took ~470,000 page faults per
    4,032-row prompt forward, its >64 MiB blocks mapped afresh each time: 16.9-18.6 s against
    14.7-15.0 s, see docs/BENCHMARKS.md)."""
    mallopt = _mallopt()
    return mallopt is not None and mallopt(M_ARENA_MAX, 1) == 1


def keep_freed_memory() -> bool:
    """Apply the settings above; False (and no change) where glibc is not the allocator."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = mallopt(M_MMAP_MAX, 0) == 1
    ok = mallopt(M_TRIM_THRESHOLD, NEVER_TRIM_BYTES) == 1 and ok
    ok = use_one_arena() and ok
    if ok:
        logger.info("CPU allocator: freed memory is kept for reuse (no mmap, no trim, "
                    "one arena)")
    return ok
