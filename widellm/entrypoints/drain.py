"""Graceful shutdown of ``widellm serve``: on SIGTERM (or Ctrl-C) stop accepting, give the
running requests ``--shutdown-timeout`` seconds to finish, then end the rest with an
OpenAI-style error (an error event and ``[DONE]`` on a stream, a JSON 503 otherwise).

uvicorn's own shutdown cancels the request tasks that outlive its timeout, which cuts a
stream without a last event and sends a plain-text 500 for the rest. Here the engine ends
them instead (``AsyncLLM.cut_in_flight``), so each request's own code writes its error, and
cancelling stays the last resort for a task that ignores even that.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import uvicorn

from widellm.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# After the cut, the requests' own error responses take a step or two to be written.
CUT_GRACE_S = 5.0
_IDLE_POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose shutdown drains ``engine``'s requests (see module docstring)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM,
                 shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        running = len(self.server_state.tasks)
        logger.info("shutting down: no new requests; %d running get up to %.1f s "
                    "(--shutdown-timeout) to finish", running, self.shutdown_timeout_s)
        self.engine.start_draining()
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        # Idle keep-alive connections close now, busy ones after their response.
        for connection in list(self.server_state.connections):
            connection.shutdown()
        if not await self._wait_idle(self.shutdown_timeout_s):
            cut = self.engine.cut_in_flight(
                f"the server shut down before this request finished "
                f"(--shutdown-timeout {self.shutdown_timeout_s:g} s)")
            logger.warning("drain timeout: ended %d running request(s) with an error", cut)
            if not await self._wait_idle(CUT_GRACE_S):
                logger.error("cancelling %d request(s) that did not end",
                             len(self.server_state.tasks))
                for task in self.server_state.tasks:
                    task.cancel()
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request task is left (True), for at most ``timeout_s`` or until a
        second Ctrl-C forces the exit (False)."""
        deadline = time.monotonic() + timeout_s
        while self.server_state.tasks and not self.force_exit:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_IDLE_POLL_S)
        return not self.server_state.tasks
