"""The launch halves of every expert-parallel backend wait on nothing.

``dispatch_launch`` and ``combine_launch`` must return without a blocking collective, without
waiting on a collective's work handle and without a host sync, so that the other micro-batch's
compute (or the shared experts) can run while the transfer is in flight. A trap, active only
inside those calls, records every blocking collective, every ``Work.wait`` and every tensor
operation that reads device data on the host (``item``, ``tolist``, ``int``/``float``/``bool``
of a tensor, ``nonzero``, boolean-mask indexing); the test asserts it recorded nothing on 2
gloo ranks, through ``FusedMoE.forward`` in a forward context that carries the step's agreed
token counts, as the engine runs it. A self-check shows the trap catches each kind.
"""

from __future__ import annotations

import contextlib
import functools

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
# Tokens per rank: uneven, and one rank with a single (dummy-sized) batch.
TOKENS = (7, 1)
RUN_TIMEOUT_S = 60
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_to_all_single", "all_gather",
               "reduce_scatter_tensor", "broadcast", "barrier")
HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "nonzero")
# Backend name -> ExpertParallelContext.fixed_capacity (all2all_fixed: the dynamic overflow
# check with a tiny capacity, and the static bound with the default one).
VARIANTS = (("allgather_reducescatter", None), ("all2all", None),
            ("all2all_fixed", 1), ("all2all_fixed", None))


class LaunchTrap:
    """Records what would block while ``active``; patches stay until ``close``."""

    def __init__(self) -> None:
        self.active = False
        self.seen: list[str] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> LaunchTrap:
        patch = self._stack.enter_context(pytest.MonkeyPatch.context())
        for name in COLLECTIVES:
            patch.setattr(dist, name, self._collective(name, getattr(dist, name)))
        for module in (dispatch_ep, dispatch_allgather):
            for name in ("all_gather_single", "reduce_scatter_single"):
                if hasattr(module, name):
                    patch.setattr(module, name, self._collective(name, getattr(module, name)))
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, self._host_read(name, getattr(torch.Tensor, name)))
        patch.setattr(torch, "nonzero", self._host_read("torch.nonzero", torch.nonzero))
        getitem = torch.Tensor.__getitem__

        def masked_getitem(tensor, index):
            parts = index if isinstance(index, tuple) else (index,)
            if self.active and any(isinstance(p, torch.Tensor) and p.dtype == torch.bool
                                   for p in parts):
                self.seen.append("boolean-mask indexing")
            return getitem(tensor, index)

        patch.setattr(torch.Tensor, "__getitem__", masked_getitem)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def guard(self, fn):
        """``fn`` with the trap active while it runs."""

        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            self.active = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.active = False

        return guarded

    def _collective(self, name, fn):
        def wrapped(*args, async_op=False, **kwargs):
            if self.active and not async_op:
                self.seen.append(f"blocking {name}")
            work = fn(*args, async_op=async_op, **kwargs)
            return _TrappedWork(work, self, name) if async_op else work

        return wrapped

    def _host_read(self, name, fn):
        def wrapped(*args, **kwargs):
            if self.active:
                self.seen.append(f"host read {name}")
            return fn(*args, **kwargs)

        return wrapped


class _TrappedWork:
    def __init__(self, work, trap: LaunchTrap, name: str) -> None:
        self._work, self._trap, self._name = work, trap, name

    def wait(self, *args, **kwargs):
        if self._trap.active:
            self._trap.seen.append(f"wait on {self._name}")
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _layer(rank: int, backend: str, capacity: int | None) -> FusedMoE:
    ep = ExpertParallelContext(rank=rank, size=WORLD_SIZE, group=dist.group.WORLD,
                               all2all_backend=backend, fixed_capacity=capacity,
                               max_tokens_per_rank=max(TOKENS), max_seqs_per_rank=max(TOKENS))
    torch.manual_seed(0)
    moe = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTER, dtype=torch.float32, ep=ep)
    moe.w13_weight.data.normal_()
    moe.w2_weight.data.normal_()
    return moe


def _rank_launches(rank: int, world_size: int) -> dict[str, list[str]]:
    seen = {}
    gen = torch.Generator().manual_seed(rank)
    hidden = torch.randn(TOKENS[rank], HIDDEN, generator=gen)
    logits = torch.randn(TOKENS[rank], NUM_EXPERTS, generator=gen)
    shared = torch.nn.Linear(HIDDEN, HIDDEN)
    for backend, capacity in VARIANTS:
        moe = _layer(rank, backend, capacity)
        with LaunchTrap() as trap:
            d = moe.dispatcher
            d.dispatch_launch = trap.guard(d.dispatch_launch)
            d.combine_launch = trap.guard(d.combine_launch)
            with torch.inference_mode(), set_forward_context(
                    dummy_attention_metadata(TOKENS[rank]), dp_metadata=DPMetadata(TOKENS)):
                out = moe(hidden, logits, padding_mask=torch.zeros(TOKENS[rank], dtype=torch.bool),
                          shared_experts=shared)
        assert out.shape == (TOKENS[rank], HIDDEN) and bool(torch.isfinite(out).all())
        seen[f"{backend}:{capacity}"] = trap.seen
    return seen


def _rank_self_check(rank: int, world_size: int) -> list[str]:
    """A launch that blocks in every way the trap knows: each must be recorded."""
    with LaunchTrap() as trap:
        def bad_launch():
            x = torch.ones(2)
            dist.all_reduce(x)
            dist.all_to_all_single(torch.empty(2), x, async_op=True).wait()
            one = x[:1]
            return one.item(), x.tolist(), int(one), bool(one), x.nonzero(), x[x > 0]

        trap.guard(bad_launch)()
        bad_launch()  # outside the guard: nothing more is recorded
    return trap.seen


def test_launch_halves_wait_on_nothing():
    for seen in run_ranks(_rank_launches, WORLD_SIZE, timeout_s=RUN_TIMEOUT_S):
        assert seen == {f"{b}:{c}": [] for b, c in VARIANTS}


def test_the_trap_records_each_kind_of_wait():
    for seen in run_ranks(_rank_self_check, WORLD_SIZE, timeout_s=RUN_TIMEOUT_S):
        assert seen == ["blocking all_reduce", "wait on all_to_all_single", "host read item",
                        "host read tolist", "host read __int__", "host read __bool__",
                        "host read nonzero", "boolean-mask indexing"]
