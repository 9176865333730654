"""Run a function on N gloo ranks (child processes on 127.0.0.1), for tests of collectives.

    def check(rank: int, world_size: int, scale: float) -> float:  # module level (picklable)
        x = torch.full((1,), rank * scale)
        dist.all_reduce(x)                 # the default process group is ready
        return float(x)

    results = run_ranks(check, 2, 0.5, timeout_s=30)   # [result of rank 0, of rank 1]

- The rendezvous store is a TCPStore the parent opens on port 0 (the OS picks a free one), so
  nothing is hard-coded and no port is picked and released before use.
- Ranks are forked from a forkserver that has imported torch and widellm once, so each run
  costs a fork, not an interpreter start plus imports.
- A rank that raises reports its traceback and the call raises :class:`RankError` at once;
  past ``timeout_s`` it raises :class:`TimeoutError`. Either way, and on success, every rank
  process is stopped (killed if it has not exited) before ``run_ranks`` returns or raises.
- Results travel pickled, so tensors come back by value.
- As with any non-fork start method, a script (not a test) calling this needs the
  ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import multiprocessing
import pickle
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
# Seconds a rank that has sent its result gets to tear its process group down and exit.
EXIT_GRACE_S = 5.0
# Modules the forkserver imports once for every rank it forks (missing ones are skipped).
PRELOAD = ["torch", "torch.distributed", "widellm"]


class RankError(RuntimeError):
    """A rank raised (the message holds its traceback) or died without a result."""


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    num_threads: int,
    args: tuple,
    conn: Connection,
) -> None:
    """Child process: join the group, run ``fn``, send ``(ok, result or traceback)``."""
    initialised = False
    try:
        torch.set_num_threads(num_threads)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        initialised = True
        payload = (True, fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        payload = (False, traceback.format_exc())
    try:
        data = pickle.dumps(payload)
    except Exception:  # noqa: BLE001 - an unpicklable result is the test's bug, say so
        data = pickle.dumps((False, traceback.format_exc()))
    # Report before tearing down: if a peer is stuck, teardown may block, the report must not.
    conn.send_bytes(data)
    conn.close()
    if initialised:
        dist.destroy_process_group()


def _stop(procs: list[multiprocessing.process.BaseProcess], grace_s: float) -> None:
    """Give processes ``grace_s`` to exit on their own, then kill the rest."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    num_threads: int = 1,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results.

    Args:
        fn: a module-level function (it is pickled by name); the default process group is
            initialised (gloo) when it runs and destroyed after.
        world_size: number of ranks.
        args: extra positional arguments, pickled to every rank.
        timeout_s: wall-clock limit for the whole run; also the process group's timeout.
        num_threads: torch intra-op threads per rank (ranks share the machine's cores).

    Returns:
        ``[result of rank 0, ..., result of rank world_size - 1]``.

    Raises:
        RankError: a rank raised or died; the first one to report is named.
        TimeoutError: not every rank reported within ``timeout_s``.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    store = dist.TCPStore(
        HOST, 0, world_size, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )
    procs: list[multiprocessing.process.BaseProcess] = []
    pending: dict[Connection, int] = {}
    grace_s = 0.0
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, store.port, timeout_s, num_threads, args, writer),
                name=f"rank{rank}",
                daemon=True,
            )
            pending[reader] = rank
            try:
                proc.start()
            finally:
                # Only the child writes: closing our copy makes its death read as end-of-file.
                writer.close()
            procs.append(proc)

        results: list[Any] = [None] * world_size
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"ranks {sorted(pending.values())} of {world_size} did not finish in {timeout_s}s"
                )
            for reader in wait(list(pending), timeout=remaining):
                rank = pending.pop(reader)
                try:
                    ok, payload = pickle.loads(reader.recv_bytes())
                except EOFError:
                    procs[rank].join(timeout=1.0)
                    raise RankError(
                        f"rank {rank} exited (code {procs[rank].exitcode}) without a result"
                    ) from None
                finally:
                    reader.close()
                if not ok:
                    raise RankError(f"rank {rank} of {world_size} failed:\n{payload}")
                results[rank] = payload
        grace_s = EXIT_GRACE_S
        return results
    finally:
        for reader in pending:
            reader.close()
        _stop(procs, grace_s)
        del store
