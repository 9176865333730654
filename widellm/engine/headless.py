"""``widellm serve --headless``: run this machine's data-parallel ranks with no API server.

The ranks connect to the head node's frontend at ``--data-parallel-address`` /
``--data-parallel-rpc-port`` and take part in the deployment like local ones; this process
only starts them and waits. It exits when they do (the frontend shuts them down), and stops
them when it is told to stop (SIGINT/SIGTERM) or one of them dies.
"""

from __future__ import annotations

import logging
import signal
import time

from widellm.engine.arg_utils import EngineArgs
from widellm.engine.core_client import (
    SHUTDOWN_GRACE_S, describe_exit, spawn_engine_cores, stop_processes,
)

logger = logging.getLogger(__name__)
_POLL_S = 0.5


def run_headless(engine_args: EngineArgs) -> None:
    config = engine_args.create_engine_config()
    pc = config.parallel_config
    if pc.data_parallel_rpc_port is None:
        raise ValueError("--headless needs --data-parallel-rpc-port (and --data-parallel-address) "
                         "of the head node")
    if pc.data_parallel_backend == "ray":
        raise ValueError("--headless starts this machine's ranks as processes; with "
                         "--data-parallel-backend ray the head node's frontend places every "
                         "rank on the Ray cluster itself (run no headless node)")
    if pc.data_parallel_start_rank == 0:
        raise ValueError("--headless runs secondary ranks: give --data-parallel-start-rank > 0")
    stop = False

    def request_stop(signum: int, _frame) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    handshake = f"tcp://{pc.data_parallel_address}:{pc.data_parallel_rpc_port}"
    procs = spawn_engine_cores(config, handshake)
    logger.info("headless: ranks %d-%d of %d, head at %s", pc.data_parallel_start_rank,
                pc.data_parallel_start_rank + pc.local_size - 1, pc.data_parallel_size, handshake)
    try:
        while not stop and all(p.is_alive() for p in procs):
            time.sleep(_POLL_S)
    finally:
        # Ranks that exited on the frontend's SHUTDOWN are joined at once; others are killed:
        # a rank left running would block its peers' collectives.
        stop_processes(procs, SHUTDOWN_GRACE_S)
    failed = [p for p in procs if p.exitcode not in (0, None)]
    if failed:
        raise SystemExit(f"headless: {failed[0].name} exited ({describe_exit(failed[0].exitcode)})")
