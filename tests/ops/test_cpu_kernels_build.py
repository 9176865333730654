"""How the CPU kernels are built: the target CPU comes from WIDELLM_CPU_MARCH and reaches the
compiler, and it is part of the build's name, so builds for two targets never stand in for
each other."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import torch

from widellm.ops import cpu_kernels
from widellm.ops.cpu_kernels import ENV_MARCH, _build_tag, build_directory, load_cpu_kernels

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
    monkeypatch.setenv(cpu_kernels.ENV_DISABLE, "1")  # build even where a run turned them off
    load_cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            assert load_cpu_kernels() is None
    finally:
        load_cpu_kernels.cache_clear()  # later tests load the real build again
    messages = [r.getMessage() for r in caplog.records]
    warnings = [m for m in messages if "CPU kernels unavailable" in m]
    assert len(warnings) == 1 and f"-march={IMPOSSIBLE_MARCH}" in warnings[0]


def test_another_checkout_is_another_build(monkeypatch, tmp_path):
    """Same sources in another folder: another build name, so two checkouts used in turn do
    not keep rebuilding one folder (torch rebuilds when the source paths change)."""
    here = _build_tag()
    copy = tmp_path / "cpu"
    shutil.copytree(cpu_kernels.SOURCE_DIR, copy)
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", copy)
    assert _build_tag() != here


def test_build_folder_names_python_and_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    assert build_directory("widellm_cpu_ops_x") == tmp_path / version / "widellm_cpu_ops_x"


STALE_LOCK_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from widellm.ops.cpu_kernels import _build_tag, build_directory, load_cpu_kernels
build_dir = build_directory(f"widellm_cpu_ops_{_build_tag()}")
build_dir.mkdir(parents=True)
(build_dir / "lock").write_text("")  # what a build killed part-way leaves behind
print("result:", load_cpu_kernels())
print("lock left:", (build_dir / "lock").exists())
"""
# Far more than the failing build needs; torch's own wait on a stale lock never ends.
STALE_LOCK_TIMEOUT_S = 180


def test_a_stale_torch_lock_is_removed_not_waited_on(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), ENV_MARCH: IMPOSSIBLE_MARCH,
           "WIDELLM_CPU_KERNELS": "1"}
    done = subprocess.run([sys.executable, "-c", STALE_LOCK_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=STALE_LOCK_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("removing ") and "killed part-way" in line for line in lines)
    assert any(line.startswith("compiling the CPU kernels") for line in lines)
    # The build then ran (and failed on the impossible target) instead of waiting forever.
    assert "result: None" in lines and "lock left: False" in lines
