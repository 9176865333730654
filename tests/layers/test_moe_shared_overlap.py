"""The shared experts run while the dispatch's rows travel, on every expert-parallel backend.

``FusedMoE.forward`` computes the shared experts between the launch of the dispatch's last
transfer and its wait: with ``all2all``, which exchanges the row counts first, that is after
``dispatch_send`` launched the rows (not in the window of the small count exchange). On 2
gloo ranks the test logs, in order, each launched transfer, each wait on one and the shared
experts' call, and checks the exact sequence per backend.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_ranks
from widellm.distributed.ep_context import ExpertParallelContext
from widellm.forward_context import DPMetadata, set_forward_context
from widellm.layers.attention_metadata import dummy_attention_metadata
from widellm.layers.moe import dispatch_allgather, dispatch_ep
from widellm.layers.moe.layer import FusedMoE

WORLD_SIZE = 2
NUM_EXPERTS = 8
TOP_K = 2
HIDDEN = 16
INTER = 8
TOKENS = (7, 3)
RUN_TIMEOUT_S = 60
COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_reduce", "all_gather")
# The backend's transfers in launch order (l: launched, w: waited; numbered per forward), with
# the shared experts (S) in the window of the dispatch's last transfer.
EXPECTED = {
    # counts (0) waited by dispatch_send before the rows (1) launch; combine is 2.
    "all2all": ["l0", "w0", "l1", "S", "w1", "l2", "w2"],
    # one dispatch transfer (0), one combine transfer (1).
    "all2all_fixed": ["l0", "S", "w0", "l1", "w1"],
    "allgather_reducescatter": ["l0", "S", "w0", "l1", "w1"],
}


class _Logged:
    def __init__(self, work, log: list[str], index: int) -> None:
        self._work, self._log, self._index = work, log, index

    def wait(self, *args, **kwargs):
        self._log.append(f"w{self._index}")
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _rank_sequences(rank: int, world_size: int) -> dict[str, list[str]]:
    gen = torch.Generator().manual_seed(rank)
    hidden = torch.randn(TOKENS[rank], HIDDEN, generator=gen)
    logits = torch.randn(TOKENS[rank], NUM_EXPERTS, generator=gen)
    linear = torch.nn.Linear(HIDDEN, HIDDEN)
    out = {}
    for backend in EXPECTED:
        log: list[str] = []
        launched = itertools.count()

        def logged(name, fn):
            def wrapped(*args, async_op=False, **kwargs):
                work = fn(*args, async_op=async_op, **kwargs)
                if not async_op:
                    log.append(f"blocking {name}")
                    return work
                index = next(launched)
                log.append(f"l{index}")
                return _Logged(work, log, index)
            return wrapped

        def shared(x: torch.Tensor) -> torch.Tensor:
            log.append("S")
            return linear(x)

        ep = ExpertParallelContext(rank=rank, size=WORLD_SIZE, group=dist.group.WORLD,
                                   all2all_backend=backend, fixed_capacity=None,
                                   max_tokens_per_rank=max(TOKENS),
                                   max_seqs_per_rank=max(TOKENS))
        torch.manual_seed(0)
        moe = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTER, dtype=torch.float32, ep=ep)
        with pytest.MonkeyPatch.context() as patch:
            for name in COLLECTIVES:
                patch.setattr(dist, name, logged(name, getattr(dist, name)))
            for module in (dispatch_ep, dispatch_allgather):
                for name in ("all_gather_single", "reduce_scatter_single"):
                    if hasattr(module, name):
                        patch.setattr(module, name, logged(name, getattr(module, name)))
            with torch.inference_mode(), set_forward_context(
                    dummy_attention_metadata(TOKENS[rank]), dp_metadata=DPMetadata(TOKENS)):
                moe(hidden, logits, padding_mask=torch.zeros(TOKENS[rank], dtype=torch.bool),
                    shared_experts=shared)
        out[backend] = log
    return out


def test_shared_experts_run_while_the_rows_travel():
    for seen in run_ranks(_rank_sequences, WORLD_SIZE, timeout_s=RUN_TIMEOUT_S):
        assert seen == EXPECTED
