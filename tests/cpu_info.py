"""What this machine's CPU can do, read independently of the code under test."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> set[str]:
    """The feature flags /proc/cpuinfo lists (empty where there is no such file)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return set(next((ln for ln in lines if ln.startswith("flags")), "").split(":")[-1].split())
