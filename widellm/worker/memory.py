"""Process memory readings."""

from __future__ import annotations

import resource

KIB = 1024


def peak_rss_bytes() -> int:
    """Peak resident set of this process, in bytes (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
