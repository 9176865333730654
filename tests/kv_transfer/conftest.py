"""The ``cluster`` fixture of the proxy tests: fake backends and proxies, all stopped on
teardown, even after a failure."""

from __future__ import annotations

import pytest

from tests.kv_transfer.proxy_fakes import FakeBackend, Served
from widellm.kv_transfer.proxy import build_app


@pytest.fixture
def cluster():
    """``backends(role, n)`` / ``pair()`` -> fake backends; ``proxy(prefill_urls, decode_urls,
    **build_app_kwargs)`` -> its URL; everything is stopped on teardown, even after a failure."""
    started: list[Served] = []

    class Cluster:
        def backends(self, role: str, n: int) -> list[FakeBackend]:
            out = [FakeBackend(role) for _ in range(n)]
            started.extend(b.served for b in out)
            return out

        def pair(self) -> tuple[FakeBackend, FakeBackend]:
            return self.backends("prefill", 1)[0], self.backends("decode", 1)[0]

        def proxy(self, prefill: list[str], decode: list[str], **kw) -> str:
            started.append(Served(build_app(prefill, decode, **kw)))
            return started[-1].url

    try:
        yield Cluster()
    finally:
        for served in started:
            served.stop()
        for served in started:
            served.join()
