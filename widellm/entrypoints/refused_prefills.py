"""A decode instance lets go of the prefill's KV blocks of a request it refuses.

A request with ``kv_transfer_params`` naming a prefill (``do_remote_prefill``) that this
server answers with a 4xx before its engine took it (a bad field, an unknown model, a prompt
too long for this instance) will never pull those blocks; the engine's connector never saw
it, so nothing else here would let them go before the producer's lease ran out. The release
goes over the producer's side channel in the background (``kv_transfer/prefill_release.py``).

Only an instance that pulls KV (``kv_consumer`` or ``kv_both``) sends releases: a server
without a connector would otherwise connect to whatever address a request named.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from widellm.entrypoints.errors import to_api_error
from widellm.kv_transfer.config import KVTransferConfig
from widellm.kv_transfer.prefill_release import PrefillReleases


def names_a_prefill(params: Any) -> bool:
    return isinstance(params, dict) and bool(params.get("do_remote_prefill"))


def is_refusal(status: int) -> bool:
    """A 4xx: the request was bad and no instance would take it. A 503 (draining) is not: a
    router sends that request on, with the same params, to another decode instance."""
    return HTTPStatus.BAD_REQUEST <= status < HTTPStatus.INTERNAL_SERVER_ERROR


class RefusedPrefills:
    """The releases of one server, counted in ``widellm:refused_prefill_releases``."""

    def __init__(self, kv_transfer_config: KVTransferConfig | None,
                 registry: CollectorRegistry) -> None:
        self.enabled = kv_transfer_config is not None and kv_transfer_config.is_consumer
        self.releases = PrefillReleases(Counter(
            "widellm:refused_prefill_releases", "Remote prefills whose held KV blocks this "
            "decode instance let go because it refused the request, by outcome", ["outcome"],
            registry=registry))

    def refused(self, params: Any) -> None:
        """The request that carried ``params`` (its ``kv_transfer_params``) was refused."""
        if self.enabled and names_a_prefill(params):
            self.releases.start(params)

    def refused_body(self, body: Any) -> None:
        """A request body that failed validation (its JSON, if it parsed)."""
        if isinstance(body, dict):
            self.refused(body.get("kv_transfer_params"))

    @contextlib.contextmanager
    def on_refusal(self, params: Any) -> Iterator[None]:
        """Around a generation route: a refusal raised inside releases ``params``' prefill."""
        try:
            yield
        except Exception as exc:
            if is_refusal(to_api_error(exc).status):
                self.refused(params)
            raise

    async def close(self) -> None:
        await self.releases.close()
