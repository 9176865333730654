"""Frontend side of the engine-core processes: start the local ranks, meet every rank (local
or on another machine) at one ROUTER socket, route each request to a rank, receive output
batches, notice when a rank dies.

All-local ranks use IPC files in a fresh temporary folder, so two servers on one host never
collide and no port is needed; a deployment that spans machines binds the ROUTER at
``--data-parallel-address:--data-parallel-rpc-port`` and the output socket at a free port of
the same address. The torch.distributed rendezvous store lives here too (a free port), so
ranks need to be told nothing but the handshake address. With ``--data-parallel-backend ray``
the ranks are Ray actors (``ray_launcher.py``) and the sockets are TCP at this node's address.

Requests go to the rank the prefix-aware load balancer picks (or a pinned
``data_parallel_rank``); every sample of an ``n > 1`` request goes to the same rank, since
they share the prompt's KV blocks. Sync methods serve the offline engine, ``*_async`` ones the
server; both use the same sockets from one thread.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Sequence

import msgspec
import torch.distributed as dist
import zmq
import zmq.asyncio

from widellm.config import EngineConfig
from widellm.core.outputs import EplbStats
from widellm.core.scheduler_stats import SchedulerStats
from widellm.distributed.load_balancer import DPLoadBalancer
from widellm.engine.core_proc import (
    HELLO, EngineCoreOutputs, HandshakeReply, ReadyMessage, RequestKind, StartupPhase,
    rank_identity, run_engine_core,
)
from widellm.engine.engine_core import EngineCoreRequest
from widellm.engine.kv_budget import share_host_memory

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
# How long a SIGKILLed rank gets to be reaped (not a grace: it cannot refuse).
KILL_REAP_S = 5.0
# How long closing the request socket may take to hand the SHUTDOWN messages of connected
# ranks (on other machines too) to the network; a failed start no longer waits a grace first.
SHUTDOWN_FLUSH_MS = 1000
_POLL_S = 0.5
# How long a rank's failure waits for another local rank's death to show (see
# ``failure_reason``); a rank failing on its own is reported this much later.
DEATH_NOTICE_S = 1.0
DEATH_POLL_S = 0.02


class EngineDeadError(RuntimeError):
    """An engine-core process is gone; requests in flight cannot complete."""


def spawn_engine_cores(config: EngineConfig, handshake_addr: str) -> list[multiprocessing.Process]:
    """Start this machine's ranks (``data_parallel_start_rank`` onwards) as processes."""
    # One reading of the host's memory for all of them: they split one KV budget.
    config = share_host_memory(config)
    pc = config.parallel_config
    # spawn, not fork: the parent may hold threads and torch state that do not fork well.
    mp = multiprocessing.get_context("spawn")
    procs = []
    # PR_SET_PDEATHSIG follows the forking thread: only safe when that is the main thread.
    use_pdeathsig = threading.current_thread() is threading.main_thread()
    for rank in range(pc.data_parallel_start_rank, pc.data_parallel_start_rank + pc.local_size):
        proc = mp.Process(target=run_engine_core,
                          args=(config, handshake_addr, rank, os.getpid(), use_pdeathsig),
                          name=f"widellm-engine-core-{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def make_ray_launcher(config: EngineConfig):
    """The Ray launcher when ``--data-parallel-backend ray`` (connected to the cluster), else
    None. Ray, an optional extra, is imported only here."""
    if config.parallel_config.data_parallel_backend != "ray":
        return None
    try:
        from widellm.engine.ray_launcher import RayLauncher
    except ImportError as e:
        raise ImportError("--data-parallel-backend ray needs Ray: pip install 'widellm[ray]'"
                          f" ({e})") from None
    return RayLauncher(config)


def describe_exit(exitcode: int | None) -> str:
    """An exit status in words: a signal by its name (multiprocessing gives -signum)."""
    if exitcode is None:
        return "still running"
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    # The kernel's OOM killer is the usual sender of an unexplained SIGKILL.
    return f"killed by {name}" + (" (out of memory?)" if -exitcode == signal.SIGKILL else "")


def describe_rank_exit(proc) -> str:
    """How a rank's process ended; a Ray rank's handle says it in words (Ray gives no status)."""
    reason = getattr(proc, "exit_reason", None)
    return reason if reason is not None else describe_exit(proc.exitcode)


def stop_processes(procs: Sequence[multiprocessing.Process], grace_s: float) -> None:
    """Give them ``grace_s`` in all to exit, then kill whatever is still running and reap it."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(KILL_REAP_S)


class EngineCoreClient:
    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        self.num_ranks = pc.data_parallel_size
        self._start_rank = pc.data_parallel_start_rank
        self._ray = make_ray_launcher(config)
        self._tmpdir = tempfile.mkdtemp(prefix="widellm-ipc-")
        # Async sockets for serving; the sync paths use shadows of the same sockets.
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.ROUTER)
        # Fail loudly, not silently drop, when sending to a rank that is not connected.
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._output = self._ctx.socket(zmq.PULL)
        # Ray ranks may be on other nodes: TCP at this node's cluster address, always.
        host = pc.data_parallel_address if self._ray is None else self._ray.frontend_host
        if pc.data_parallel_rpc_port is None and self._ray is None:
            handshake_addr = f"ipc://{os.path.join(self._tmpdir, 'input')}"
            self._input.bind(handshake_addr)
            self._output.bind(f"ipc://{os.path.join(self._tmpdir, 'output')}")
        else:
            self._input.bind(f"tcp://{host}:{pc.data_parallel_rpc_port or '*'}")
            handshake_addr = self._input.getsockopt_string(zmq.LAST_ENDPOINT)
            self._output.bind(f"tcp://{host}:*")
        self._output_addr = self._output.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sync_in = zmq.Socket.shadow(self._input.underlying)
        self._sync_out = zmq.Socket.shadow(self._output.underlying)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        # The rendezvous of the ranks' process groups, reachable wherever the ROUTER is.
        self._store = (
            dist.TCPStore(host, 0, None, True, wait_for_workers=False)
            if pc.needs_lockstep else None
        )
        self.procs: list = []
        self._req_rank: dict[str, int] = {}
        # Each rank's latest scheduler stats (KV usage, queue lengths), for logs and tests.
        self.last_stats: dict[int, SchedulerStats] = {}
        # Each rank's latest step-time totals (with --collect-step-breakdown).
        self.last_breakdown: dict[int, dict[str, float]] = {}
        self.peak_rss_bytes: dict[int, int] = {}
        self.eplb_stats: dict[int, EplbStats] = {}
        # Each rank's KV connector endpoint (disaggregated prefill/decode), from its READY.
        self.kv_endpoints: dict[int, dict] = {}
        try:
            # multiprocessing.Process objects, or handles to Ray actors that read the same.
            self.procs = (spawn_engine_cores(config, handshake_addr) if self._ray is None
                          else self._ray.start(handshake_addr))
            self.num_kv_blocks = self._handshake(host, pc.engine_ready_timeout_s)
        except BaseException:
            # A failed start stops its ranks at once: one still importing or loading would
            # not read the shutdown message before the grace ran out, and none holds
            # anything worth saving yet.
            self.shutdown(grace_s=0.0)
            raise
        self.balancer = DPLoadBalancer(
            self.num_ranks, config.cache_config.block_size, max_tracked_blocks=self.num_kv_blocks
        )

    # ---- start-up ------------------------------------------------------------------------

    def _handshake(self, store_host: str, timeout_s: float) -> int:
        """Answer each rank's HELLO, then wait for every READY; returns the smallest KV pool.
        Time while any rank reports a :class:`StartupPhase` (the CPU kernel build) is not
        counted against ``timeout_s``."""
        reply = self._encoder.encode(HandshakeReply(
            self._output_addr, store_host, self._store.port if self._store else 0))
        poller = zmq.Poller()
        poller.register(self._sync_in, zmq.POLLIN)
        poller.register(self._sync_out, zmq.POLLIN)
        ready: dict[int, int] = {}
        in_phase: dict[int, tuple[str, float]] = {}  # rank -> (phase, its start)
        waited, last = 0.0, time.monotonic()
        while len(ready) < self.num_ranks:
            now = time.monotonic()
            waited += 0.0 if in_phase else now - last
            last = now
            if waited >= timeout_s:
                missing = sorted(set(range(self.num_ranks)) - set(ready))
                raise RuntimeError(f"engine cores {missing} not ready after {waited:.0f} s "
                                   "(raise --engine-ready-timeout-s if they are still loading)")
            events = dict(poller.poll(int(_POLL_S * 1000)))
            if self._sync_in in events:
                identity, kind, _ = self._sync_in.recv_multipart()
                if kind == HELLO:
                    self._sync_in.send_multipart([identity, reply])
            if self._sync_out in events:
                msg = self._startup_message(self._sync_out.recv())
                if isinstance(msg, ReadyMessage):
                    ready[msg.dp_rank] = msg.num_kv_blocks
                    if msg.kv_endpoint is not None:
                        self.kv_endpoints[msg.dp_rank] = msg.kv_endpoint
                elif msg.started:
                    in_phase[msg.dp_rank] = (msg.phase, time.monotonic())
                elif msg.dp_rank in in_phase:
                    _, began = in_phase.pop(msg.dp_rank)
                    logger.info("engine core %d: %s took %.1f s (not counted in "
                                "--engine-ready-timeout-s)", msg.dp_rank, msg.phase,
                                time.monotonic() - began)
            dead = [p for p in self.procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"engine core exited during start-up "
                                   f"({dead[0].name}, {describe_rank_exit(dead[0])})")
        self.kv_blocks_by_rank = ready  # each rank's KV pool, for widellm:cache_config_info
        return min(ready.values())

    def _startup_message(self, raw: bytes) -> ReadyMessage | StartupPhase:
        """A rank's READY or phase report; RuntimeError for a rank that failed to start."""
        try:
            return msgspec.msgpack.decode(raw, type=ReadyMessage | StartupPhase)
        except msgspec.ValidationError:
            err = self._decoder.decode(raw)
            raise RuntimeError(
                f"engine core {err.dp_rank} failed to start: {err.engine_error}") from None

    # ---- health --------------------------------------------------------------------------

    def is_alive(self) -> bool:
        # Poll every process, not up to the first dead one: polling reaps an exited core,
        # which would otherwise stay a zombie while the server lives on.
        return all([p.is_alive() for p in self.procs])

    def _dead(self) -> list[tuple[int, multiprocessing.Process]]:
        start = self._start_rank
        return [(start + i, p) for i, p in enumerate(self.procs) if not p.is_alive()]

    def dead_reason(self) -> str:
        dead = self._dead()
        if not dead:
            return "engine core is not running"
        # A rank that crashed, not one that returned after reporting its peers' failure.
        rank, proc = next(((r, p) for r, p in dead if p.exitcode != 0), dead[0])
        return f"engine core {rank} (pid {proc.pid}) died: {describe_rank_exit(proc)}"

    def failure_reason(self, rank: int, engine_error: str) -> str:
        """Why the engine failed when ``rank`` reports ``engine_error``. When another local
        rank has died, the survivors' collectives failing is the symptom, not the cause: the
        dead rank is named first. Its death can trail the survivors' error by a moment (the
        kernel closes its sockets before it becomes a zombie): callers first wait up to
        :data:`DEATH_NOTICE_S` while :meth:`others_alive`."""
        reported = f"engine core {rank} failed: {engine_error}"
        if any(r != rank for r, _ in self._dead()):
            return f"{self.dead_reason()}; then {reported}"
        return reported

    def others_alive(self, rank: int) -> bool:
        """Whether every local rank but ``rank`` is still running (remote ranks unknown)."""
        return all(r == rank for r, _ in self._dead())

    # ---- routing -------------------------------------------------------------------------

    def rank_of(self, request_id: str) -> int | None:
        """The rank serving core request ``request_id`` (None when not routed or finished)."""
        return self._req_rank.get(request_id)

    def check_rank(self, data_parallel_rank: int | None) -> None:
        """ValueError unless ``data_parallel_rank`` is None or an existing rank."""
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < self.num_ranks:
            raise ValueError(f"data_parallel_rank must be in [0, {self.num_ranks}), "
                             f"got {data_parallel_rank}")

    def _frames(self, kind: RequestKind, rank: int, payload: bytes) -> list[bytes]:
        return [rank_identity(rank), int(kind).to_bytes(1, "little"), payload]

    def _route(self, requests: Sequence[EngineCoreRequest],
               data_parallel_rank: int | None) -> list[list[bytes]]:
        """Frames sending the samples of one request to one rank (the balancer's choice
        unless pinned), each counted in flight there."""
        self.check_rank(data_parallel_rank)
        prompt, salt = requests[0].prompt_token_ids, requests[0].cache_salt
        rank = data_parallel_rank
        frames = []
        for request in requests:
            if rank is None:
                rank = self.balancer.choose_rank(prompt, salt)
            else:
                self.balancer.assign(rank, prompt, salt)
            self._req_rank[request.request_id] = rank
            frames.append(self._frames(RequestKind.ADD, rank, self._encoder.encode(request)))
        return frames

    def _route_aborts(self, request_ids: Sequence[str]) -> list[list[bytes]]:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self._req_rank.pop(rid, None)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
                self.balancer.request_finished(rank)
        return [self._frames(RequestKind.ABORT, rank, self._encoder.encode(ids))
                for rank, ids in by_rank.items()]

    def _on_batch(self, raw: bytes) -> EngineCoreOutputs:
        batch = self._decoder.decode(raw)
        for out in batch.outputs:
            if out.finished and self._req_rank.pop(out.request_id, None) is not None:
                self.balancer.request_finished(batch.dp_rank)
        self.peak_rss_bytes[batch.dp_rank] = batch.peak_rss_bytes
        if batch.eplb_stats is not None:
            self.eplb_stats[batch.dp_rank] = batch.eplb_stats
        if batch.step_breakdown is not None:
            self.last_breakdown[batch.dp_rank] = batch.step_breakdown
        stats = batch.scheduler_stats
        if stats is not None:
            self.last_stats[batch.dp_rank] = stats
            self.balancer.update_stats(batch.dp_rank, stats.num_waiting_reqs,
                                       stats.num_running_reqs)
        return batch

    # ---- sync (offline engine) -----------------------------------------------------------

    def add_requests(self, requests: Sequence[EngineCoreRequest],
                     data_parallel_rank: int | None = None) -> None:
        """Send the samples of one request (all share its prompt) to one rank."""
        for frames in self._route(requests, data_parallel_rank):
            self._sync_in.send_multipart(frames)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        for frames in self._route_aborts(request_ids):
            try:
                self._sync_in.send_multipart(frames)
            except zmq.ZMQError:
                pass  # that rank is gone: nothing left to abort there

    def get_output(self, timeout_s: float) -> EngineCoreOutputs | None:
        """The next output batch from any rank, or None after ``timeout_s`` without one."""
        if not self._sync_out.poll(int(timeout_s * 1000)):
            return None
        return self._on_batch(self._sync_out.recv())

    # ---- async (server) ------------------------------------------------------------------

    async def add_requests_async(self, requests: Sequence[EngineCoreRequest],
                                 data_parallel_rank: int | None = None) -> None:
        for frames in self._route(requests, data_parallel_rank):
            await self._input.send_multipart(frames)

    async def abort_requests_async(self, request_ids: Sequence[str]) -> None:
        for frames in self._route_aborts(request_ids):
            try:
                await self._input.send_multipart(frames)
            except zmq.ZMQError:
                pass  # that rank is gone: nothing left to abort there

    async def get_output_async(self, timeout_s: float) -> EngineCoreOutputs | None:
        if not await self._output.poll(int(timeout_s * 1000)):
            return None
        return self._on_batch(await self._output.recv())

    # ---- shutdown ------------------------------------------------------------------------

    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Tell every rank (local or remote) to stop, wait ``grace_s`` for the local ones,
        kill laggards."""
        for rank in range(self.num_ranks):
            try:
                self._sync_in.send_multipart(self._frames(RequestKind.SHUTDOWN, rank, b""),
                                             flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # that rank never connected or is gone
        if self._ray is None:
            stop_processes(self.procs, grace_s)
        else:
            self._ray.stop(grace_s)
        self._input.close(linger=SHUTDOWN_FLUSH_MS)
        self._output.close(linger=0)
        self._ctx.term()
        self._store = None
        shutil.rmtree(self._tmpdir, ignore_errors=True)
