"""The compiled CPU kernels, for every kernel test here."""

from __future__ import annotations

import os
import shutil

import pytest

from widellm.ops.cpu_kernels import ENV_DISABLE, load_cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    if os.environ.get(ENV_DISABLE) == "0":
        pytest.skip(f"{ENV_DISABLE}=0")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the engine runs the torch reference paths")
    # Not a skip otherwise: a machine with a compiler that cannot build the kernels is a failure.
    module = load_cpu_kernels()
    assert module is not None
    return module
