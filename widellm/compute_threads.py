"""Threads that run torch compute must start with the engine's thread count.

torch applies ``torch.set_num_threads`` to a new thread lazily, on the thread's first
``at::parallel_for``; a oneDNN kernel (the packed linears) that runs first in a new thread
uses OpenMP's default instead, the machine's core count. A data-parallel rank that was given
one core of two would then start a two-thread OpenMP team on its DBO micro-batch thread and
keep it: both ranks' teams on both cores, and an OpenMP pool more in the process (see
``engine_core.py``). ``torch.get_num_threads()`` runs that lazy set-up, so calling it first
thing in each such thread (the ``initializer`` of its executor) makes every thread agree.
"""

from __future__ import annotations

import torch


def init_compute_thread() -> None:
    """Apply the process's torch thread count to the calling thread (a thread initializer)."""
    torch.get_num_threads()
