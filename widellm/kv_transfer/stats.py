"""KV transfer counters (per instance rank), reported with the scheduler stats."""

from __future__ import annotations

import msgspec

# Why a load failed; each is a label value of widellm:kv_transfer_failures_total.
FAILURE_CAUSES = (
    "connection",      # producer unreachable, or the connection broke (a killed instance)
    "timeout",         # no complete payload within transfer_timeout_s
    "checksum",        # a layer's bytes do not match their crc32
    "short_payload",   # the producer sent fewer bytes than it announced
    "engine_mismatch",  # the producer at that address is another engine (it restarted)
    "unknown_request",  # the producer holds no such request (lease expired, or released)
    "layout",          # the producer's KV layout (layers, shapes, dtype, block size) differs
    "prompt_mismatch",  # the parameters were made for another prompt
)


class KVTransferStats(msgspec.Struct, omit_defaults=True, gc=False):
    """Counters since the instance started, and what is held now.

    Attributes:
        bytes_received / bytes_sent: KV payload bytes moved (headers excluded).
        recv_seconds / send_seconds: wall time of completed loads / sends.
        num_loads / num_sends: completed transfers.
        failures: consumer: failed loads by cause.
        send_failures: producer: sends that broke off, by cause.
        leases_expired: producer: held requests freed because their lease ran out.
        num_requests_held / num_blocks_held: producer: held for a consumer right now.
        num_recomputed: consumer: failed loads recomputed locally (policy ``recompute``).
    """

    bytes_received: int = 0
    bytes_sent: int = 0
    recv_seconds: float = 0.0
    send_seconds: float = 0.0
    num_loads: int = 0
    num_sends: int = 0
    failures: dict[str, int] = {}
    send_failures: dict[str, int] = {}
    leases_expired: int = 0
    num_requests_held: int = 0
    num_blocks_held: int = 0
    num_recomputed: int = 0

    def snapshot(self, leases_expired: int, num_requests_held: int,
                 num_blocks_held: int) -> "KVTransferStats":
        """A copy (its dicts too) with the current hold numbers, for the metrics."""
        return msgspec.structs.replace(
            self, failures=dict(self.failures), send_failures=dict(self.send_failures),
            leases_expired=leases_expired, num_requests_held=num_requests_held,
            num_blocks_held=num_blocks_held)


class TransferError(Exception):
    """A transfer that failed for ``cause`` (one of FAILURE_CAUSES)."""

    def __init__(self, cause: str, message: str) -> None:
        assert cause in FAILURE_CAUSES, cause
        super().__init__(f"{cause}: {message}")
        self.cause = cause
