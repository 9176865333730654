"""How the CPU kernels are built: the target CPU comes from WIDELLM_CPU_MARCH and reaches the
compiler, and it is part of the build's name, so builds for two targets never stand in for
each other."""

from __future__ import annotations

import logging

from widellm.ops import cpu_kernels
from widellm.ops.cpu_kernels import ENV_MARCH, _build_tag, load_cpu_kernels

IMPOSSIBLE_MARCH = "no-such-cpu-widellm"  # no compiler knows it: the build must fail


def test_another_march_is_another_build(monkeypatch):
    monkeypatch.delenv(ENV_MARCH, raising=False)
    native = _build_tag()
    monkeypatch.setenv(ENV_MARCH, "x86-64-v3")
    assert _build_tag() != native
    monkeypatch.setenv(ENV_MARCH, "native")
    assert _build_tag() == native


def test_march_reaches_the_compiler(monkeypatch, caplog, tmp_path):
    """A target no compiler knows fails the build: the kernels are reported unavailable (a
    warning, the torch paths run) rather than a build for another target being loaded."""
    monkeypatch.setenv(ENV_MARCH, IMPOSSIBLE_MARCH)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    load_cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            assert load_cpu_kernels() is None
    finally:
        load_cpu_kernels.cache_clear()  # later tests load the real build again
    messages = [r.getMessage() for r in caplog.records]
    warnings = [m for m in messages if "CPU kernels unavailable" in m]
    assert len(warnings) == 1 and f"-march={IMPOSSIBLE_MARCH}" in warnings[0]
