"""The allocator setting takes effect: once a large block has been used and freed, allocating
and filling one of the same size again takes (almost) no new page faults."""

from __future__ import annotations

import resource

import torch

from widellm.worker.cpu_allocator import keep_freed_memory

BIG = 64 << 20  # above glibc's largest mmap threshold (32 MiB), so normally mmap'd
PAGE = 4096
WARMUP_ALLOCATIONS = 3


def _faults_filling_a_fresh_block() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(BIG, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_large_blocks_are_reused_without_page_faults():
    assert keep_freed_memory()
    for _ in range(WARMUP_ALLOCATIONS):  # the heap grows to its working size first
        _faults_filling_a_fresh_block()
    # Without the setting every call faults in BIG / PAGE = 16384 pages again.
    assert _faults_filling_a_fresh_block() < BIG // PAGE // 10
