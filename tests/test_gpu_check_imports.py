"""``benchmarks/gpu/check.sh`` runs under the GPU machines' own python3, which holds torch,
triton and transformers but only some of widellm's dependencies; the rest travel there as
wheels (``benchmarks/gpu/wheels.py``). These tests keep that list honest on CPU, so that the
first GPU run does not spend its device time on an ImportError: every dependency in
pyproject.toml is on the image, carried or server-only; so are the carried packages' own; and
with the server-only and test-only packages hidden, everything check.sh imports still imports.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import wheels  # noqa: E402  (benchmarks/gpu/wheels.py)

IMPORT_TIMEOUT_S = 180
# What check.sh imports: the package, the engine, its scripts and the kernel tests it runs.
CHECKED_MODULES = (
    "widellm", "widellm.engine.llm", "widellm.engine.llm_engine", "device_side",
    "engine_parity", "graph_speedup", "ep32_slice", "kernel_rates", "tests.conftest",
    *(f"tests.ops.triton.{p.stem}" for p in sorted((ROOT / "tests/ops/triton").glob("test_*.py"))),
)
# Import names of what is neither on the image nor carried: server-only and test-only packages.
HIDDEN = ("fastapi", "starlette", "uvicorn", "openai", "jsonschema", "ray")
# The image's interpreter, for the requirements' environment markers.
IMAGE_MARKERS = {"python_version": wheels.PYTHON_VERSION, "implementation_name": "cpython",
                 "platform_python_implementation": "CPython", "sys_platform": "linux",
                 "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}

_CHILD = """
import importlib, importlib.abc, sys
hidden = set(sys.argv[1].split(","))

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in hidden:
            raise ModuleNotFoundError(f"{name} is not on the GPU machines' image")

sys.meta_path.insert(0, Hide())
sys.path[:0] = [sys.argv[3], sys.argv[3] + "/benchmarks/gpu"]
for module in sys.argv[2].split(","):
    importlib.import_module(module)
"""


def _needed(requirements: list[str]) -> set[str]:
    """Normalized names of the requirements the image's interpreter installs (no extras)."""
    reqs = [Requirement(r) for r in requirements]
    return {re.sub(r"[-_.]+", "-", r.name).lower() for r in reqs
            if r.marker is None or r.marker.evaluate(IMAGE_MARKERS)}


def test_every_dependency_is_on_the_image_carried_or_server_only():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    known = wheels.ON_IMAGE | set(wheels.CARRIED) | wheels.SERVER_ONLY
    assert sorted(_needed(deps) - known) == []


def test_the_carried_packages_need_nothing_else():
    known = wheels.ON_IMAGE | set(wheels.CARRIED)
    for dist in wheels.CARRIED:
        assert sorted(_needed(importlib.metadata.requires(dist) or []) - known) == [], dist


def test_the_pins_are_the_installed_versions():
    assert wheels.pinned() == [f"{d}=={importlib.metadata.version(d)}" for d in wheels.CARRIED]


@pytest.mark.timeout(IMPORT_TIMEOUT_S + 30)
def test_check_sh_imports_without_the_server_and_test_packages():
    done = subprocess.run([sys.executable, "-c", _CHILD, ",".join(HIDDEN),
                           ",".join(CHECKED_MODULES), str(ROOT)],
                          capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def test_hiding_a_needed_package_is_seen():
    """The control: hide a carried package the engine imports, and the import fails."""
    done = subprocess.run([sys.executable, "-c", _CHILD, "msgspec", "widellm.engine.llm_engine",
                           str(ROOT)], capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S,
                          cwd=ROOT)
    assert done.returncode != 0 and "not on the GPU machines' image" in done.stderr
