"""The decode forward a CUDA graph records makes no host synchronisation, checked on CPU.

A CUDA graph cannot record a read of a device value by the host (``.item()``, ``.tolist()``,
``bool(t)``) nor an op whose output size depends on the data (``nonzero``, ``bincount``, ...):
capture fails, or worse, replays stale sizes. The GPU path of a decode step is the Triton
attention backend plus the Triton routed experts (``experts_forward`` picks them for CUDA
tensors); here both run in Triton's interpreter on CPU tensors while every torch op and every
host read of a tensor outside the kernels is recorded. The CPU experts path, which does sync,
shows the check catches what it looks for."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from widellm import LLM, SamplingParams
from widellm.layers.moe.experts_triton import triton_experts_forward

# Ops whose result the host must read, or whose output size depends on the data.
SYNCING_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique",
                         "_unique2", "unique_consecutive", "bincount", "repeat_interleave"})
# Tensor methods that hand a tensor's values to Python.
HOST_READS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _in_triton(stack: traceback.StackSummary) -> bool:
    """Frames of Triton's interpreter: it reads tensors on the host by design (the kernels)."""
    return any("/triton/" in frame.filename for frame in stack)


class HostSyncRecorder(TorchDispatchMode):
    """Records the syncing ops and host reads made outside Triton's kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self._saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def _record(self, what: str) -> None:
        stack = traceback.extract_stack()[:-2]
        if not _in_triton(stack):
            self.found.append(f"{what} at {stack[-1].filename}:{stack[-1].lineno}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in SYNCING_OPS:
            self._record(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, self._recording(name, method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def _recording(self, name, method):
        def read(tensor, *args, **kwargs):
            self._record(name)
            return method(tensor, *args, **kwargs)
        return read


def _syncs_in_graph_steps(path: str) -> tuple[list[str], int]:
    """Host syncs of every decode step run through the graph runner, and how many ran."""
    # Small step budgets: the interpreter runs the start-up warm-up's kernels too.
    with LLM(path, dtype="float32", num_kv_blocks=16, max_model_len=64, max_num_seqs=4,
             max_num_batched_tokens=64, cuda_graph_sizes="1,2,4",
             attention_backend="triton") as llm:
        runner = llm.llm_engine.engine_core.model_runner
        runner.capture_decode_graphs(eager=True)
        run, found, steps = runner.graphs.run, [], []

        def recorded(md):
            steps.append(md.num_tokens)
            with HostSyncRecorder() as recorder:
                out = run(md)
            found.extend(recorder.found)
            return out

        runner.graphs.run = recorded
        llm.generate([[5, 6, 7, 8], [9, 10, 11]],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
    return found, len(steps)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM",
                                  "Qwen3MoeForCausalLM"])
def test_graph_decode_step_makes_no_host_sync(model_dir, monkeypatch, arch):
    monkeypatch.setattr("widellm.layers.moe.layer.experts_forward", triton_experts_forward)
    found, steps = _syncs_in_graph_steps(model_dir(arch))
    assert steps == 3  # the three decode steps after the prompts' step
    assert found == []


def test_the_check_catches_the_cpu_experts_syncs(model_dir):
    found, steps = _syncs_in_graph_steps(model_dir("DeepseekV3ForCausalLM"))
    assert steps == 3
    assert any(f.startswith("tolist at ") and f.split(" at ")[1].split(":")[0].endswith(
        "layers/moe/experts.py") for f in found), found
