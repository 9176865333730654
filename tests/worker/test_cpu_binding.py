"""``WIDELLM_CPU_OMP_THREADS_BIND``: which CPUs each local rank's engine core is pinned to, and
that pinning reaches every thread of the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from widellm.worker.cpu_binding import (
    CPU_BIND_ENV,
    by_core,
    parse_cpu_list,
    plan_cpu_binding,
    read_topology,
)

CHILD_TIMEOUT_S = 60
needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                    reason="CPU affinity is Linux-only")


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list(" 5 ") == [5]
    assert parse_cpu_list("2,1-2") == [1, 2]
    for bad in ("", "a", "3-1", "-1", "0-", "1,,2"):
        with pytest.raises(ValueError, match=CPU_BIND_ENV):
            parse_cpu_list(bad)


def test_auto_gives_each_local_rank_a_slice_in_the_given_order():
    allowed = [4, 5, 6, 7, 8, 9, 10, 11]
    assert [plan_cpu_binding("auto", allowed, 2, r) for r in range(2)] == [
        [4, 5, 6, 7], [8, 9, 10, 11]]
    # 8 CPUs over 3 ranks: 2 each, the last two left to the OS.
    assert [plan_cpu_binding("auto", allowed, 3, r) for r in range(3)] == [
        [4, 5], [6, 7], [8, 9]]
    # Hyperthreads c and c + 4 of 4 cores: each rank gets whole cores.
    ordered = by_core(range(8), {c: (0, c % 4) for c in range(8)})
    assert ordered == [0, 4, 1, 5, 2, 6, 3, 7]
    assert [plan_cpu_binding("auto", ordered, 2, r) for r in range(2)] == [
        [0, 1, 4, 5], [2, 3, 6, 7]]


def test_core_order_puts_sockets_first_and_unknown_cpus_by_number():
    topo = {0: (1, 0), 1: (0, 0), 2: (0, 1), 3: (1, 1)}
    assert by_core([3, 2, 1, 0, 9], topo) == [1, 2, 9, 0, 3]
    here = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    assert set(read_topology(here)) <= set(here)


def test_nothing_is_pinned_by_default_or_where_auto_cannot_help():
    assert plan_cpu_binding("auto", [0, 1, 2, 3], 1, 0) is None  # one rank: the whole machine
    assert plan_cpu_binding("auto", [0, 1], 4, 3) is None  # more ranks than CPUs
    assert plan_cpu_binding("auto", [0, 1, 2, 3], 2, 0, ray=True) is None  # Ray places ranks
    assert plan_cpu_binding("nobind", [0, 1, 2, 3], 2, 0) is None
    assert plan_cpu_binding("", [0, 1, 2, 3], 2, 0) is None  # empty reads as the default


def test_explicit_lists_one_per_local_rank():
    assert plan_cpu_binding("0-1|4", [0, 1, 2, 3, 4], 2, 0) == [0, 1]
    assert plan_cpu_binding("0-1|4", [0, 1, 2, 3, 4], 2, 1) == [4]
    assert plan_cpu_binding("3", [0, 1, 2, 3], 1, 0) == [3]  # one rank may be pinned too
    with pytest.raises(ValueError, match="gives 2 CPU lists for 3 local rank"):
        plan_cpu_binding("0|1", [0, 1, 2], 3, 0)
    with pytest.raises(ValueError, match=r"CPUs \[7\] of local rank 1 are not available"):
        plan_cpu_binding("0|6-7", [0, 1, 2, 3, 4, 5, 6], 2, 1)


@needs_affinity
def test_pinning_reaches_threads_started_before_and_after():
    cpu = min(os.sched_getaffinity(0))
    child = textwrap.dedent("""
        import os, threading
        from widellm.worker.cpu_binding import pin_engine_core
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        cpus = pin_engine_core(local_size=1, local_rank=0, ray=False)
        after = threading.Thread(target=stop.wait); after.start()
        ids = [threading.get_native_id(), before.native_id, after.native_id]
        ids += [int(t) for t in os.listdir("/proc/self/task")]  # any other thread too
        seen = sorted({tuple(sorted(os.sched_getaffinity(t))) for t in ids})
        stop.set(); before.join(); after.join()
        print(cpus, seen)
    """)
    env = {**os.environ, CPU_BIND_ENV: str(cpu)}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S, check=True).stdout.split()
    # Every thread (main, the one started before, the one after) is on the one CPU.
    assert out == [f"[{cpu}]", f"[({cpu},)]"]
