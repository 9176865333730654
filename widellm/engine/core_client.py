"""Frontend side of the engine-core process: start it, send requests and aborts, receive
output batches, notice when it dies.

Sockets are IPC files in a fresh temporary folder, so two servers on one host never collide
and no port is needed.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile

import msgspec
import zmq
import zmq.asyncio

from widellm.config import EngineConfig
from widellm.engine.core_proc import (
    EngineCoreOutputs, ReadyMessage, RequestKind, run_engine_core,
)
from widellm.engine.engine_core import EngineCoreRequest

logger = logging.getLogger(__name__)

# Loading a large checkpoint can take minutes; a core that says nothing for this long is dead.
STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_GRACE_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; requests in flight cannot complete."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="widellm-ipc-")
        input_addr = f"ipc://{os.path.join(self._tmpdir, 'input')}"
        output_addr = f"ipc://{os.path.join(self._tmpdir, 'output')}"
        # A plain (sync) context for the blocking start-up handshake, async for serving.
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(output_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        # spawn, not fork: the frontend may hold threads and torch state that do not fork well.
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=run_engine_core, args=(config, input_addr, output_addr),
                               name="widellm-engine-core", daemon=True)
        self.proc.start()
        self.num_kv_blocks = self._wait_ready()

    def _wait_ready(self) -> int:
        sync_sock = zmq.Socket.shadow(self._output.underlying)
        poller = zmq.Poller()
        poller.register(sync_sock, zmq.POLLIN)
        waited = 0.0
        step_s = 0.5
        while waited < STARTUP_TIMEOUT_S:
            if poller.poll(int(step_s * 1000)):
                raw = sync_sock.recv()
                try:
                    ready = msgspec.msgpack.decode(raw, type=ReadyMessage)
                except msgspec.ValidationError:
                    err = self._decoder.decode(raw).engine_error
                    self.shutdown()
                    raise RuntimeError(f"engine core failed to start: {err}") from None
                return ready.num_kv_blocks
            if not self.proc.is_alive():
                self.shutdown()
                raise RuntimeError(
                    f"engine core exited during start-up (exit code {self.proc.exitcode})"
                )
            waited += step_s
        self.shutdown()
        raise RuntimeError(f"engine core not ready after {STARTUP_TIMEOUT_S:.0f} s")

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    async def add_request(self, request: EngineCoreRequest) -> None:
        await self._send(RequestKind.ADD, self._encoder.encode(request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(RequestKind.ABORT, self._encoder.encode(request_ids))

    async def get_output(self, timeout_s: float) -> EngineCoreOutputs | None:
        """The next output batch, or None after ``timeout_s`` without one."""
        if not await self._output.poll(int(timeout_s * 1000)):
            return None
        return self._decoder.decode(await self._output.recv())

    async def _send(self, kind: RequestKind, payload: bytes) -> None:
        await self._input.send_multipart([int(kind).to_bytes(1, "little"), payload])

    def shutdown(self) -> None:
        if self.proc.is_alive():
            try:
                sync_in = zmq.Socket.shadow(self._input.underlying)
                sync_in.send_multipart([int(RequestKind.SHUTDOWN).to_bytes(1, "little"), b""],
                                       flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(SHUTDOWN_GRACE_S)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(SHUTDOWN_GRACE_S)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
