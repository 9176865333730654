"""The allocator setting takes effect: once a large block has been used and freed, allocating
and filling one of the same size again takes (almost) no new page faults.

``keep_freed_memory`` changes glibc's ``mallopt`` for the whole process, so the check runs in
a child process: the tests after it keep the allocator they would have in production."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

BIG = 64 << 20  # above glibc's largest mmap threshold (32 MiB), so normally mmap'd
PAGE = 4096
WARMUP_ALLOCATIONS = 3
CHILD_TIMEOUT_S = 120  # a torch import on a loaded 2-core machine takes a few seconds

_CHILD = textwrap.dedent(f"""
    import resource, sys, torch
    from widellm.worker.cpu_allocator import keep_freed_memory

    def faults():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty({BIG}, dtype=torch.uint8).fill_(1)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    first = faults()
    ok = keep_freed_memory()
    for _ in range({WARMUP_ALLOCATIONS}):  # the heap grows to its working size first
        faults()
    print(first, int(ok), faults())
""")


def _child_faults() -> tuple[int, bool, int]:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S, check=True)
    first, ok, after = out.stdout.split()
    return int(first), ok == "1", int(after)


@pytest.mark.timeout(CHILD_TIMEOUT_S + 30)
def test_large_blocks_are_reused_without_page_faults():
    first, ok, after = _child_faults()
    assert ok
    # Before the setting the first fill faults in (nearly) all BIG / PAGE = 16384 pages: the
    # measure works; after it, a refill of a freed block faults in almost none.
    assert first > BIG // PAGE // 2
    assert after < BIG // PAGE // 10
