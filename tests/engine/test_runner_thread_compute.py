"""With async scheduling the runner thread loads the model, warms it up and runs every
forward; the engine loop's thread runs no parallel torch op. OpenMP keeps a pool of worker
threads per thread that ever ran a parallel region, and once there are two, their workers
sleep between regions instead of spinning (measured: decode steps 15-30% slower).

The check, in a child process with two torch threads: after building an async engine and
generating, the main thread runs one parallel op. If the main thread already had a pool,
that op starts no thread; if (as it must) it had none, exactly one new OS thread appears,
its first pool worker. The control run builds a synchronous engine (which computes on the
main thread) and sees no new thread: the measure can tell the two apart."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

CHILD_TIMEOUT_S = 240

_CHILD = textwrap.dedent("""
    import json, os, sys, torch
    torch.set_num_threads(2)
    from widellm import LLM, SamplingParams

    def tasks():
        return set(os.listdir("/proc/self/task"))

    llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=64, max_model_len=256,
              async_scheduling=sys.argv[2] == "async")
    llm.generate([[5, 6, 7, 8] * 8], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)
    before = tasks()
    a = torch.ones(1 << 20)
    (a * 2).sum()  # a parallel region on the main thread (above the grain size)
    print(json.dumps({"new_threads": len(tasks() - before)}))
""")


def _new_threads(model: str, mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHILD, model, mode], capture_output=True,
                         text=True, timeout=CHILD_TIMEOUT_S, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["new_threads"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.timeout(2 * CHILD_TIMEOUT_S + 30)
def test_the_loop_thread_never_starts_an_openmp_pool(model_dir):
    model = model_dir("LlamaForCausalLM")
    assert _new_threads(model, "async") == 1
    assert _new_threads(model, "sync") == 0
