"""The engine core in its own process, talking to the frontend over ZMQ.

Frames are msgpack (msgspec). Frontend -> core on a PULL socket: ``(kind, payload)`` with kind
``ADD`` (an EngineCoreRequest), ``ABORT`` (request ids) or ``SHUTDOWN``. Core -> frontend on
a PUSH socket: ``EngineCoreOutputs`` batches, one per step that produced anything, carrying
scheduler stats. The loop steps while there is work and blocks on the socket when idle, so an
idle server burns no CPU. A crash sends one ``EngineCoreOutputs`` with ``engine_error`` set
before the process exits, so in-flight requests fail fast instead of hanging.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import time
import traceback

import msgspec
import zmq

from widellm.config import EngineConfig
from widellm.core.outputs import EngineCoreOutput
from widellm.core.scheduler import SchedulerStats
from widellm.engine.engine_core import EngineCore, EngineCoreRequest

logger = logging.getLogger(__name__)

# How long an idle core blocks on its input socket before re-checking for shutdown.
IDLE_POLL_MS = 1000


class RequestKind(enum.IntEnum):
    ADD = 0
    ABORT = 1
    SHUTDOWN = 2


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    engine_error: str | None = None


class ReadyMessage(msgspec.Struct, array_like=True):
    num_kv_blocks: int
    pid: int


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Process entry point (spawned by the frontend client)."""
    # The frontend owns Ctrl-C; the core stops when told to or when its parent goes away.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("WIDELLM_LOGGING_LEVEL", "INFO"),
                        format="%(levelname)s %(asctime)s core: %(message)s", datefmt="%H:%M:%S")
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        core = EngineCore(config)
        out.send(encoder.encode(ReadyMessage(core.scheduler.kv_cache_manager.block_pool.num_blocks,
                                             os.getpid())))
        _serve(core, inp, out, encoder)
    except Exception as e:  # report, then die: the frontend fails in-flight requests
        logger.error("engine core failed:\n%s", traceback.format_exc())
        out.send(encoder.encode(EngineCoreOutputs(engine_error=f"{type(e).__name__}: {e}")))
    finally:
        out.close(linger=1000)
        inp.close(linger=0)
        ctx.term()


def _serve(core: EngineCore, inp: zmq.Socket, out: zmq.Socket,
           encoder: msgspec.msgpack.Encoder) -> None:
    decode_add = msgspec.msgpack.Decoder(EngineCoreRequest)
    decode_ids = msgspec.msgpack.Decoder(list[str])
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    stats_dirty = False  # an abort changed the KV usage the frontend last saw
    while True:
        busy = core.has_unfinished_requests()
        # Drain everything that arrived; block only when there is nothing to step.
        timeout = 0 if busy else IDLE_POLL_MS
        while poller.poll(timeout):
            kind_frame, payload = inp.recv_multipart()
            kind = RequestKind(int.from_bytes(kind_frame, "little"))
            if kind == RequestKind.SHUTDOWN:
                core.shutdown()
                return
            if kind == RequestKind.ADD:
                core.add_request(decode_add.decode(payload))
            else:
                core.abort_requests(decode_ids.decode(payload))
                stats_dirty = True
            timeout = 0
        if os.getppid() == 1:  # orphaned: the frontend died without a goodbye
            core.shutdown()
            return
        if not core.has_unfinished_requests():
            if stats_dirty:
                out.send(encoder.encode(EngineCoreOutputs(
                    scheduler_stats=core.scheduler.make_stats(), timestamp=time.time())))
                stats_dirty = False
            continue
        outputs = core.step()
        stats_dirty = False
        if outputs or not core.has_unfinished_requests():
            out.send(encoder.encode(EngineCoreOutputs(
                outputs=outputs, scheduler_stats=core.scheduler.make_stats(),
                timestamp=time.time(),
            )))
