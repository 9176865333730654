"""A thread started with ``init_compute_thread`` runs OpenMP regions (oneDNN's included)
with torch's thread count; without it a fresh thread's OpenMP default is the core count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD_TIMEOUT_S = 120

_CHILD = textwrap.dedent("""
    import ctypes, json, os, torch
    from concurrent.futures import ThreadPoolExecutor
    from widellm.compute_threads import init_compute_thread
    torch.set_num_threads(1)
    gomp = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"))
    seen = {}
    for name, init in (("with", init_compute_thread), ("without", None)):
        with ThreadPoolExecutor(1, initializer=init) as pool:
            seen[name] = pool.submit(gomp.omp_get_max_threads).result()
    print(json.dumps(seen))
""")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs a default above one thread")
@pytest.mark.skipif(not os.path.exists(os.path.join(
    os.path.dirname(__import__("torch").__file__), "lib", "libgomp.so.1")),
    reason="torch built without its own libgomp")
@pytest.mark.timeout(CHILD_TIMEOUT_S + 30)
def test_a_compute_thread_takes_torchs_thread_count():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["with"] == 1
    assert seen["without"] == os.cpu_count()
