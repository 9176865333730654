"""Pin each data-parallel rank's engine-core process to CPUs of its own
(``WIDELLM_CPU_OMP_THREADS_BIND``, the counterpart of vLLM's ``VLLM_CPU_OMP_THREADS_BIND``).

Ranks on one machine share its cores. Unpinned, the OS moves every thread of every rank (the
OpenMP compute team, gloo's transfer threads, the loop thread) over all of them: one rank's
helper threads may preempt another rank's compute, and memory may sit on another socket than
the threads that use it. Pinned, a rank's threads share only its own cores. It is a trade on
this project's 2-core machine (docs/BENCHMARKS.md, DP2 + EP2, one core per rank): decode
spent ~40% less time blocked in MoE transfers and ran 2-11% faster, but prompt-heavy runs
were 3-14% slower, because a pinned rank's gloo threads can no longer use the core its peer
leaves idle while it waits. So nothing is pinned unless asked; on multi-socket machines
pin each rank to its socket (vLLM's CPU backend pins by default).

Values, as vLLM reads its variable:

- ``nobind`` (the default): nothing is pinned.
- ``auto``: with two or more ranks on this machine and at least one allowed CPU per rank,
  local rank ``i`` gets the ``i``-th slice of the CPUs this process may use
  (``sched_getaffinity``: a container's cpuset is respected), ordered by socket and core so
  that a core's hyperthreads land in one slice; otherwise nothing is pinned (one rank, more
  ranks than CPUs, or ``--data-parallel-backend ray``, where Ray places the ranks).
- A list per local rank, separated by ``|``: ``0-3|4-7`` (ranges and commas: ``0-3,8``).

Several deployments on one machine each count only their own ranks: give them disjoint
lists, or ``nobind``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence

CPU_BIND_ENV = "WIDELLM_CPU_OMP_THREADS_BIND"
AUTO = "auto"
NOBIND = "nobind"


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]`` (sorted, without repeats)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"{CPU_BIND_ENV}: {text!r} is not a CPU list such as 0-3,8") from None
        if first < 0 or last < first:
            raise ValueError(f"{CPU_BIND_ENV}: bad CPU range {part.strip()!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def by_core(cpus: Collection[int], topology: Mapping[int, tuple[int, int]]) -> list[int]:
    """``cpus`` ordered by (socket, core), so a core's hyperthreads are neighbours; a CPU
    missing from ``topology`` (``cpu -> (package id, core id)``) sorts as socket 0, core
    number = its own number.

    Example (4 cores, 2 threads each, siblings numbered ``c`` and ``c + 4``):
    ``by_core(range(8), {c: (0, c % 4) for c in range(8)}) == [0, 4, 1, 5, 2, 6, 3, 7]``.
    """
    return sorted(cpus, key=lambda c: (*topology.get(c, (0, c)), c))


def read_topology(cpus: Collection[int]) -> dict[int, tuple[int, int]]:
    """``cpu -> (physical package id, core id)`` from sysfs, for the CPUs it describes."""
    topo = {}
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as p, open(f"{base}/core_id") as c:
                topo[cpu] = (int(p.read()), int(c.read()))
        except (OSError, ValueError):
            pass
    return topo


def plan_cpu_binding(spec: str, allowed: Sequence[int], local_size: int, local_rank: int,
                     ray: bool = False) -> list[int] | None:
    """The CPUs local rank ``local_rank`` of ``local_size`` is pinned to, or None (unpinned).
    ``auto`` slices ``allowed`` in the order given (see :func:`by_core`).

    Example: ``plan_cpu_binding("auto", [0, 1, 2, 3], 2, 1) == [2, 3]``;
    ``plan_cpu_binding("0-1|4", [0, 1, 2, 3, 4], 2, 1) == [4]``.
    """
    spec = spec.strip() or NOBIND
    if spec == NOBIND:
        return None
    if spec == AUTO:
        per = len(allowed) // local_size
        if ray or local_size < 2 or per < 1:
            return None
        return sorted(allowed[local_rank * per:(local_rank + 1) * per])
    lists = spec.split("|")
    if len(lists) != local_size:
        raise ValueError(f"{CPU_BIND_ENV}={spec!r} gives {len(lists)} CPU lists for "
                         f"{local_size} local rank(s): one per rank, separated by '|'")
    cpus = parse_cpu_list(lists[local_rank])
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(f"{CPU_BIND_ENV}={spec!r}: CPUs {outside} of local rank {local_rank} "
                         f"are not available to this process (allowed: {sorted(allowed)})")
    return cpus


def bind_this_process(cpus: Sequence[int]) -> None:
    """Pin every thread of this process, present ones included (zmq's, for instance), and
    through inheritance every thread it starts later."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that exited meanwhile
            pass


def pin_engine_core(local_size: int, local_rank: int, ray: bool) -> list[int] | None:
    """Apply ``WIDELLM_CPU_OMP_THREADS_BIND`` to this engine-core process; returns the CPUs it
    was pinned to (None: unpinned). Raises ValueError for a value it cannot honour."""
    spec = os.environ.get(CPU_BIND_ENV, NOBIND).strip()
    if spec in ("", NOBIND):
        return None
    if not hasattr(os, "sched_setaffinity"):  # not Linux
        if spec == AUTO:
            return None
        raise ValueError(f"{CPU_BIND_ENV}={spec!r}: pinning needs Linux's sched_setaffinity")
    allowed = os.sched_getaffinity(0)
    # Only auto slices by position; explicit lists just need to be allowed.
    ordered = by_core(allowed, read_topology(allowed)) if spec == AUTO else sorted(allowed)
    cpus = plan_cpu_binding(spec, ordered, local_size, local_rank, ray)
    if cpus is not None:
        bind_this_process(cpus)
    return cpus
