"""Binding an HTTP front's listening socket before anything else starts (the server, the
proxy): a taken port fails at once, and no ephemeral port opened later can take it."""

from __future__ import annotations

import logging
import socket
import sys

logger = logging.getLogger(__name__)


def bind_or_exit(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) (port 0: a free one); exits 1 if it cannot."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", host, port, e)
        sys.exit(1)
