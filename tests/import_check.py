"""Which modules a piece of code loads, run in a fresh interpreter (this one has loaded
everything the suite needed)."""

from __future__ import annotations

import subprocess
import sys

TIMEOUT_S = 120


def modules_loaded_by(code: str, modules: tuple[str, ...]) -> list[str]:
    """Those of ``modules`` in ``sys.modules`` after ``code`` ran in a new interpreter."""
    check = f"{code}\nimport sys\nprint(','.join(m for m in {modules!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return [m for m in done.stdout.strip().split(",") if m]
