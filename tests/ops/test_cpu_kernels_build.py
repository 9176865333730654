"""How the CPU kernels are built: the target CPU comes from WIDELLM_CPU_MARCH, and it is part of
the build's name, so builds for two targets never stand in for each other."""

from __future__ import annotations

from widellm.ops.cpu_kernels import DEFAULT_MARCH, ENV_MARCH, _build_tag, cflags


def test_march_defaults_to_native(monkeypatch):
    monkeypatch.delenv(ENV_MARCH, raising=False)
    assert DEFAULT_MARCH == "native"
    assert cflags() == ["-O3", "-march=native", "-fopenmp"]


def test_another_march_is_another_build(monkeypatch):
    monkeypatch.delenv(ENV_MARCH, raising=False)
    native = _build_tag()
    monkeypatch.setenv(ENV_MARCH, "x86-64-v3")
    assert cflags() == ["-O3", "-march=x86-64-v3", "-fopenmp"]
    assert _build_tag() != native
    monkeypatch.setenv(ENV_MARCH, "native")
    assert _build_tag() == native
