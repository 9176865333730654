"""Prometheus metrics of the KV connector (disaggregated prefill/decode), per rank: bytes and
time moved, transfers and failures by cause, expired leases, recomputed loads and the blocks
a prefill instance holds for its consumers right now. ``engine``: the data-parallel rank."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from widellm.kv_transfer.stats import KVTransferStats

_ZERO = KVTransferStats()


class KVTransferMetrics:
    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._labels = labels
        names = [*labels, "engine"]
        r = registry
        self.bytes = Counter("widellm:kv_transfer_bytes", "KV payload bytes moved",
                             [*names, "direction"], registry=r)
        self.seconds = Counter("widellm:kv_transfer_seconds", "Wall time of completed KV "
                               "transfers", [*names, "direction"], registry=r)
        self.transfers = Counter("widellm:kv_transfers", "Completed KV transfers",
                                 [*names, "direction"], registry=r)
        self.failures = Counter("widellm:kv_transfer_failures", "KV transfers that failed, by "
                                "cause (recv: loads, send: sends that broke off)",
                                [*names, "direction", "cause"], registry=r)
        self.leases_expired = Counter("widellm:kv_transfer_leases_expired", "Held prompts "
                                      "freed because no consumer pulled them in time", names,
                                      registry=r)
        self.recomputed = Counter("widellm:kv_transfer_recomputed", "Failed loads whose prompt "
                                  "was computed locally (kv_load_failure_policy recompute)",
                                  names, registry=r)
        self.blocks_held = Gauge("widellm:kv_transfer_blocks_held", "KV blocks of finished "
                                 "prompts held for a consumer to pull", names, registry=r)
        self.requests_held = Gauge("widellm:kv_transfer_requests_held", "Finished prompts held "
                                   "for a consumer to pull", names, registry=r)
        self._last: dict[int, KVTransferStats] = {}

    def record(self, stats: KVTransferStats, engine: int) -> None:
        """Advance the counters by what changed since ``engine``'s previous report."""
        lb = {**self._labels, "engine": str(engine)}
        last = self._last.get(engine, _ZERO)
        for direction, (b, s, n) in {
            "recv": (stats.bytes_received - last.bytes_received,
                     stats.recv_seconds - last.recv_seconds, stats.num_loads - last.num_loads),
            "send": (stats.bytes_sent - last.bytes_sent, stats.send_seconds - last.send_seconds,
                     stats.num_sends - last.num_sends),
        }.items():
            self.bytes.labels(**lb, direction=direction).inc(max(0, b))
            self.seconds.labels(**lb, direction=direction).inc(max(0.0, s))
            self.transfers.labels(**lb, direction=direction).inc(max(0, n))
        for direction, now, before in (("recv", stats.failures, last.failures),
                                       ("send", stats.send_failures, last.send_failures)):
            for cause, count in now.items():
                self.failures.labels(**lb, direction=direction, cause=cause).inc(
                    max(0, count - before.get(cause, 0)))
        self.leases_expired.labels(**lb).inc(max(0, stats.leases_expired - last.leases_expired))
        self.recomputed.labels(**lb).inc(max(0, stats.num_recomputed - last.num_recomputed))
        self.blocks_held.labels(**lb).set(stats.num_blocks_held)
        self.requests_held.labels(**lb).set(stats.num_requests_held)
        self._last[engine] = stats
