"""Test-only fault injection for KV transfers, off unless ``WIDELLM_TEST_KV_FAULT_FILE`` is set.

The file holds one fault to apply to the next transfers: on a producer ``corrupt``, ``short``,
``stall:SECONDS`` or ``exit_mid_transfer``; on a consumer ``delay_pull:SECONDS`` (it waits,
heartbeating, before it pulls). Empty or missing means none. A file, not a fixed
setting, so one running instance can be put through each failure in turn.
"""

from __future__ import annotations

import os

FAULT_FILE_ENV = "WIDELLM_TEST_KV_FAULT_FILE"
FAULTS = ("corrupt", "short", "stall", "exit_mid_transfer", "delay_pull")


def current_fault() -> tuple[str, float]:
    """(fault name or "", its argument) as the fault file says now."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return "", 0.0
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return "", 0.0
    name, _, arg = text.partition(":")
    if name and name not in FAULTS:
        raise ValueError(f"{FAULT_FILE_ENV}: unknown fault {name!r}; known: {FAULTS}")
    return name, float(arg or 0)
