"""The engine core in its own process (one per data-parallel rank), talking to the frontend
over ZMQ.

Start-up: the core connects a DEALER socket (identity = its rank) to the frontend's ROUTER at
``handshake_addr`` and says HELLO; the frontend answers where to send outputs and where the
torch.distributed rendezvous store is. Only that one address has to be known, so ranks on
another machine (``--headless``) find everything from ``--data-parallel-address`` and
``--data-parallel-rpc-port``. The core then joins the process groups, builds the model and
sends READY. Before that it may report start-up phases (``StartupPhase``: the CPU kernel
build) that the frontend's start-up timeout leaves out.

Frames are msgpack (msgspec). Frontend -> core: ``(kind, payload)`` with kind ``ADD`` (an
EngineCoreRequest), ``ABORT`` (request ids) or ``SHUTDOWN``. Core -> frontend on a PUSH
socket: ``EngineCoreOutputs`` batches, one per step that produced anything, with scheduler
stats and the rank. The loop steps while there is work and blocks on the socket when idle. A
crash sends one ``EngineCoreOutputs`` with ``engine_error`` set before the process exits, so
in-flight requests fail fast instead of hanging.

With expert parallelism the ranks step in lockstep (``distributed/lockstep.py``): each loop
iteration schedules, then all-gathers one small vote per rank ("have work / shutting down /
rows of my forward"); ranks without work run a dummy batch while any rank has work, and the
MoE layers read the agreed rows instead of agreeing on sizes themselves. With async
scheduling the vote and the forward run on the runner thread (``lockstep_pipeline``), so one
thread issues all of a rank's collectives while this one schedules the next step.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import torch
import zmq

from widellm.comm_trace import trace_dir
from widellm.config import EngineConfig
from widellm.core.outputs import EngineCoreOutput, EplbStats
from widellm.core.scheduler_stats import SchedulerStats
from widellm.distributed.groups import DPGroups, destroy_dp_groups, init_dp_groups
from widellm.distributed.lockstep import DPLockstep
from widellm.engine.engine_core import EngineCore, EngineCoreRequest
from widellm.engine.lockstep_pipeline import LockstepPipeline
from widellm.gc_heap import freeze_startup_heap
from widellm.ops.cpu_kernels import load_cpu_kernels
from widellm.step_timer import maybe_phase
from widellm.worker.cpu_allocator import use_one_arena
from widellm.worker.cpu_binding import pin_engine_core
from widellm.worker.memory import peak_rss_bytes

logger = logging.getLogger(__name__)

# How long an idle core blocks on its input socket before re-checking for shutdown.
IDLE_POLL_MS = 1000
# Idle lockstep ranks meet in an all-reduce this often: the most a new request waits for the
# other ranks to join its first step.
LOCKSTEP_IDLE_POLL_MS = 10
# While KV transfers are in flight and nothing else runs, how often the loop looks whether
# they ended (a loaded request's first step waits at most this long for it).
KV_TRANSFER_POLL_MS = 2
HELLO = b"HELLO"
# prctl(2) option: the signal this process gets when its parent thread exits.
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """Have the kernel SIGKILL this process when its parent goes away (Linux), and exit now if
    it is already gone. SIGKILL, not a catchable signal: a core stuck in a kernel or a
    collective must not outlive the server, and nothing of its state is worth saving.

    PR_SET_PDEATHSIG fires when the parent *thread* that forked us exits, not the parent
    process; the spawner passes ``use_pdeathsig`` only when it forks from its main thread
    (else an engine built in a short-lived thread would lose its cores with the thread). The
    pid comparison in the core loop covers the rest (and non-Linux systems)."""
    if use_pdeathsig and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
    if os.getppid() != parent_pid:  # died before the prctl took effect
        os._exit(0)


def parent_alive(parent_pid: int) -> bool:
    """Whether the process that started this one is still our parent. Comparing with its
    recorded pid (not with 1) is right when the server itself is PID 1 (a container) and when
    a subreaper, not init, adopts an orphan."""
    return os.getppid() == parent_pid


class RequestKind(enum.IntEnum):
    ADD = 0
    ABORT = 1
    SHUTDOWN = 2


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    # When the batch went out, on the engine core's clock (that of its outputs' queued_ts).
    timestamp: float = 0.0
    engine_error: str | None = None
    dp_rank: int = 0
    # Seconds per step phase summed since start (with --collect-step-breakdown).
    step_breakdown: dict[str, float] | None = None
    peak_rss_bytes: int = 0  # of this rank's process
    eplb_stats: EplbStats | None = None


class HandshakeReply(msgspec.Struct, array_like=True):
    output_addr: str
    store_host: str
    store_port: int  # 0 when there is a single rank (no process group)


class ReadyMessage(msgspec.Struct, array_like=True, tag="ready"):
    dp_rank: int
    num_kv_blocks: int
    pid: int
    # Where a KV consumer reaches this rank's connector (its ``transfer_params``), if any.
    kv_endpoint: dict | None = None


class StartupPhase(msgspec.Struct, array_like=True, tag="phase"):
    """A rank entering (``started``) or leaving a start-up phase the frontend reports and
    does not count against ``--engine-ready-timeout-s``: the one-time CPU kernel build takes
    minutes on a small machine, loading a model seconds, and only the second is a hang."""
    dp_rank: int
    phase: str
    started: bool


# The phase of compiling (or loading the cached build of) the CPU kernels.
KERNEL_BUILD_PHASE = "building the CPU kernels"
# Test hook: seconds a core sleeps inside the kernel build phase (a slow first build).
TEST_KERNEL_BUILD_SLEEP_ENV = "WIDELLM_TEST_KERNEL_BUILD_SLEEP_S"


def rank_identity(rank: int) -> bytes:
    """ZMQ identity of a rank's DEALER socket, as the frontend's ROUTER addresses it."""
    return b"rank-%d" % rank


def run_engine_core(config: EngineConfig, handshake_addr: str, dp_rank: int,
                    parent_pid: int | None = None, use_pdeathsig: bool = False) -> None:
    """Process entry point (spawned by the frontend client or a headless launcher, which pass
    their pid as ``parent_pid``)."""
    # The frontend owns Ctrl-C; the core stops when told to or when its parent goes away.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not config.on_cuda:
        use_one_arena()  # before zmq's and gloo's threads start (see cpu_allocator)
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    die_with_parent(parent_pid, use_pdeathsig)
    logging.basicConfig(level=os.environ.get("WIDELLM_LOGGING_LEVEL", "INFO"),
                        format=f"%(levelname)s %(asctime)s core{dp_rank}: %(message)s",
                        datefmt="%H:%M:%S")
    pc = config.parallel_config
    config = config.replace(parallel_config=dataclasses.replace(pc, data_parallel_rank=dp_rank))
    ctx = zmq.Context()
    inp = ctx.socket(zmq.DEALER)
    inp.setsockopt(zmq.IDENTITY, rank_identity(dp_rank))
    inp.connect(handshake_addr)
    inp.send_multipart([HELLO, msgspec.msgpack.encode(dp_rank)])
    reply = msgspec.msgpack.decode(inp.recv(), type=HandshakeReply)
    out = ctx.socket(zmq.PUSH)
    out.connect(reply.output_addr)
    encoder = msgspec.msgpack.Encoder()
    groups = None
    try:
        if config.on_cuda:
            torch.cuda.set_device((dp_rank - pc.data_parallel_start_rank) % torch.cuda.device_count())
        else:
            cpus = pin_engine_core(pc.local_size, dp_rank - pc.data_parallel_start_rank,
                                   ray=pc.data_parallel_backend == "ray")
            if "OMP_NUM_THREADS" not in os.environ and (cpus or pc.local_size > 1):
                # Ranks on one machine share its cores; more threads than cores make every
                # rank's GEMMs and the lockstep collectives wait on the OS scheduler.
                torch.set_num_threads(len(cpus) if cpus else
                                      max(1, (os.cpu_count() or 1) // pc.local_size))
            logger.info("engine core %d: %d compute threads, %s", dp_rank,
                        torch.get_num_threads(), f"pinned to CPUs {cpus}" if cpus else "unpinned")
            _load_kernels(out, encoder, dp_rank)
        if pc.needs_lockstep:
            groups = init_dp_groups(dp_rank, pc.data_parallel_size, reply.store_host,
                                    reply.store_port, pc.distributed_timeout_s, config.device)
        core = EngineCore(config, groups)
        freeze_startup_heap(f"engine core {dp_rank}")
        endpoint = core.kv_worker.transfer_params() if core.kv_worker is not None else {}
        out.send(encoder.encode(ReadyMessage(
            dp_rank, core.scheduler.kv_cache_manager.block_pool.num_blocks, os.getpid(),
            endpoint or None)))
        _CoreLoop(core, inp, out, encoder, dp_rank, groups, parent_pid).run()
        log = core.step_timer.exchange_log if core.step_timer is not None else None
        if log is not None:
            log.dump(trace_dir() / f"rank{dp_rank}.json")
    except Exception as e:  # report, then die: the frontend fails in-flight requests
        logger.error("engine core failed:\n%s", traceback.format_exc())
        out.send(encoder.encode(EngineCoreOutputs(engine_error=f"{type(e).__name__}: {e}",
                                                  dp_rank=dp_rank)))
    finally:
        out.close(linger=1000)
        inp.close(linger=0)
        ctx.term()
        if groups is not None:
            destroy_dp_groups()


def _load_kernels(out: zmq.Socket, encoder: msgspec.msgpack.Encoder, dp_rank: int) -> None:
    """Build or load the CPU kernels now (the model loader would otherwise, inside the
    timed start-up), inside a :data:`KERNEL_BUILD_PHASE` the frontend does not time."""
    out.send(encoder.encode(StartupPhase(dp_rank, KERNEL_BUILD_PHASE, True)))
    load_cpu_kernels()
    time.sleep(float(os.environ.get(TEST_KERNEL_BUILD_SLEEP_ENV, "0") or 0))
    out.send(encoder.encode(StartupPhase(dp_rank, KERNEL_BUILD_PHASE, False)))


class _CoreLoop:
    """Receive requests, step, send outputs, until told to stop."""

    def __init__(self, core: EngineCore, inp: zmq.Socket, out: zmq.Socket,
                 encoder: msgspec.msgpack.Encoder, dp_rank: int, groups: DPGroups | None,
                 parent_pid: int) -> None:
        self.core, self.inp, self.out, self.encoder = core, inp, out, encoder
        self.dp_rank, self.parent_pid = dp_rank, parent_pid
        self.lockstep = DPLockstep(groups.cpu_group) if core.lockstep else None
        self.decode_add = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.decode_ids = msgspec.msgpack.Decoder(list[str])
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)
        self.shutdown_requested = False
        self.stats_dirty = False  # an abort changed the KV usage the frontend last saw

    def run(self) -> None:
        if self.lockstep is None:
            self._run_independent()
        elif self.core.async_scheduling:
            self._run_lockstep_async()
        else:
            self._run_lockstep()
        self.core.shutdown()

    def _run_independent(self) -> None:
        core, runner = self.core, self.core.model_runner
        while True:
            busy = core.has_unfinished_requests() or runner.sizes_to_warm
            self._drain(0 if busy else self._idle_poll_ms(IDLE_POLL_MS))
            self._poll_pending()
            if self.shutdown_requested:
                return
            if not core.has_unfinished_requests():
                self._send_stats_if_dirty()
                core.warm_next_size()  # idle: build one more batch shape's kernels
                continue
            self._step()

    def _run_lockstep(self) -> None:
        core, in_wave = self.core, False
        while True:
            busy = in_wave or core.has_unfinished_requests()
            self._drain(0 if busy else self._idle_poll_ms(LOCKSTEP_IDLE_POLL_MS))
            self._poll_pending()
            # Scheduled before the vote: the vote carries the forward's row count.
            step = core.plan_step()
            with maybe_phase(core.step_timer, "lockstep_sync"):
                state = core.vote_step(self.lockstep, step, self.shutdown_requested)
            if state.any_shutdown:
                return
            in_wave = state.any_has_work
            if not in_wave:
                self._send_stats_if_dirty()
                core.warm_next_size()  # local work only, no collective
                continue
            outputs = core.run_planned_step(step, state)
            if step.has_work:
                self._stepped(outputs)

    def _run_lockstep_async(self) -> None:
        """Lockstep with the next step scheduled while the current one runs: the runner thread
        votes and runs the forwards (one owner of the rank's collectives, see
        ``lockstep_pipeline``); this thread only receives, schedules and sends."""
        core, in_wave = self.core, False
        pipe = LockstepPipeline(core, self.lockstep)
        while True:
            busy = in_wave or core.has_unfinished_requests() or bool(pipe.in_flight)
            self._drain(0 if busy else self._idle_poll_ms(LOCKSTEP_IDLE_POLL_MS))
            self._poll_pending()
            if not pipe.full and (core.scheduler.has_unfinished_requests()
                                  or not pipe.in_flight):
                so = core.schedule_step()
                pipe.submit(so, self.shutdown_requested)
                if not pipe.full and so is not None and not so.is_empty:
                    continue  # fill the pipeline before blocking on a result
            done = pipe.collect()
            if done.shutdown:
                return
            in_wave = done.agreement.any_has_work
            if done.runner_output is not None:
                outputs = core.finish_step(done.scheduler_output, done.runner_output)
                core.count_step(done.start)
                self._stepped(outputs)
            elif not in_wave and not pipe.in_flight:
                self._send_stats_if_dirty()
                core.warm_next_size()  # the runner thread is idle: no race

    def _drain(self, timeout_ms: int) -> None:
        """Apply everything that arrived, waiting up to ``timeout_ms`` for the first frame."""
        while not self.shutdown_requested and self.poller.poll(timeout_ms):
            kind_frame, payload = self.inp.recv_multipart()
            kind = RequestKind(int.from_bytes(kind_frame, "little"))
            if kind == RequestKind.SHUTDOWN:
                self.shutdown_requested = True
            elif kind == RequestKind.ADD:
                self.core.add_request(self.decode_add.decode(payload))
            else:
                self.core.abort_requests(self.decode_ids.decode(payload))
                self.stats_dirty = True
            timeout_ms = 0
        if not parent_alive(self.parent_pid):  # the frontend (or launcher) died, no goodbye
            logger.warning("parent process %d is gone; stopping", self.parent_pid)
            self.shutdown_requested = True

    def _idle_poll_ms(self, idle_ms: int) -> int:
        core = self.core
        waiting = core.has_pending_kv_transfers() or core.structured.has_pending
        return KV_TRANSFER_POLL_MS if waiting else idle_ms

    def _poll_pending(self) -> None:
        """Hand ended KV transfers to the scheduler; a request the connector failed is
        answered now, and a change in held blocks reaches the metrics."""
        outputs = self.core.poll_pending()
        if outputs is None:
            return
        if outputs:
            self._send(outputs)
        else:
            self.stats_dirty = True

    def _step(self) -> None:
        self._stepped(self.core.step())

    def _stepped(self, outputs: list[EngineCoreOutput]) -> None:
        self.stats_dirty = False
        if outputs or not self.core.has_unfinished_requests():
            self._send(outputs)

    def _send_stats_if_dirty(self) -> None:
        if self.stats_dirty:
            self._send([])
            self.stats_dirty = False

    def _send(self, outputs: list[EngineCoreOutput]) -> None:
        timer = self.core.step_timer
        eplb = self.core.model_runner.eplb
        self.out.send(self.encoder.encode(EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.core.make_stats(),
            timestamp=self.core.clock(), dp_rank=self.dp_rank,
            step_breakdown=dict(timer.totals) if timer is not None else None,
            peak_rss_bytes=peak_rss_bytes(),
            eplb_stats=eplb.stats if eplb is not None else None,
        )))
