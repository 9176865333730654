"""``--kv-transfer-config``: which KV connector an instance runs and in which role.

The JSON is vLLM's: ``{"kv_connector": "TCPConnector", "kv_role": "kv_producer",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}``. A prefill pool
runs ``kv_producer`` (it keeps a finished prompt's blocks for the decode side to pull), a
decode pool ``kv_consumer`` (it loads a request's prompt KV instead of computing it), and
``kv_both`` does either, request by request, as the ``kv_transfer_params`` ask.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from widellm.json_flags import parse_json_object

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
# vLLM's default lease on a finished prompt's blocks: long enough for a decode instance's
# queue, short enough that blocks of a decode instance that died come back soon.
DEFAULT_LEASE_S = 30.0
# A pull that has not finished in this time fails (and follows the failure policy).
DEFAULT_TRANSFER_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """One instance's connector.

    Attributes:
        kv_connector: a name in ``kv_transfer.registry`` (``TCPConnector``, ``FileConnector``).
        kv_role: ``kv_producer``, ``kv_consumer`` or ``kv_both``.
        kv_load_failure_policy: what a consumer does when a load fails: ``recompute`` the
            prompt itself, or ``fail`` the request with an error the client sees.
        kv_connector_extra_config: the connector's own settings (see each connector).
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "recompute"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of "
                             f"{KV_LOAD_FAILURE_POLICIES}, got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @property
    def lease_s(self) -> float:
        return float(self.extra("lease_s", DEFAULT_LEASE_S))

    @property
    def transfer_timeout_s(self) -> float:
        return float(self.extra("transfer_timeout_s", DEFAULT_TRANSFER_TIMEOUT_S))

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | KVTransferConfig | None"
              ) -> "KVTransferConfig | None":
        """The flag's JSON (or an ``LLM(kv_transfer_config={...})`` dict) as a config."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = parse_json_object(value, "--kv-transfer-config",
                                  {f.name for f in dataclasses.fields(cls)})
        if "kv_connector" not in value:
            raise ValueError("--kv-transfer-config needs \"kv_connector\"")
        return cls(**value)
