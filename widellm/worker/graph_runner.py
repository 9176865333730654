"""Decode steps as CUDA graphs: one graph per capture size over the persistent step buffers.

Lifecycle (one runner per engine, after the KV cache is bound to the layers):

1. ``capture()``: for every size, largest first, run the model once on the buffers (kernel
   autotuning, lazy allocations) and record it; all graphs share one memory pool, so the
   smaller ones reuse the largest one's activations.
2. per decode step: the model runner loads the step into the buffers
   (:meth:`DecodeStepBuffers.load`) and calls ``run(md)``; the graph of ``md.num_tokens`` rows
   replays and the first rows of its output buffer are the step's hidden states.

What is recorded is the model itself (``model(input_ids, positions)`` inside a forward context
whose metadata views the buffers): the one definition of every layer, no copy of it.

:class:`EagerGraphRunner` is the reference twin, and the CPU's: it runs the same model on the
same buffers and padded metadata, without recording, so CPU tests check everything a graph
depends on (the buffers, the padding rows, the fixed-shape decode metadata) token for token.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch
from torch import nn

from widellm.forward_context import DPMetadata, set_forward_context
from widellm.layers.attention_metadata import AttentionMetadata
from widellm.worker.step_buffers import DecodeStepBuffers

logger = logging.getLogger(__name__)

# Eager runs before each capture: the first compiles Triton kernels and allocates lazily, the
# second runs as the recorded one will (what PyTorch's CUDA graph notes advise).
WARMUP_RUNS = 2


class GraphRunner(ABC):
    """Replays decode steps of the capture ``sizes`` over ``buffers``.

    Under expert parallelism (``ep_size`` ranks) a graph records its MoE layers' exchanges as
    if every rank ran ``size`` rows: only backends whose exchanges do not depend on the other
    ranks' rows are recorded (``MoEDispatcher.capturable``), so each rank replays its own size
    while the others replay theirs or run eagerly through the same fixed-shape exchanges.
    """

    def __init__(self, model: nn.Module, buffers: DecodeStepBuffers,
                 sizes: tuple[int, ...], ep_size: int | None = None) -> None:
        if not sizes or max(sizes) > buffers.max_rows:
            raise ValueError(f"capture sizes {sizes} do not fit buffers of {buffers.max_rows} rows")
        self.model = model
        self.buffers = buffers
        self.sizes = tuple(sorted(sizes))
        self.ep_size = ep_size

    def forward_once(self, md: AttentionMetadata) -> torch.Tensor:
        """The model on the first ``md.num_tokens`` rows of the buffers: [size, hidden]."""
        size = md.num_tokens
        dp = DPMetadata((size,) * self.ep_size) if self.ep_size is not None else None
        with set_forward_context(md, dp_metadata=dp):
            return self.model(self.buffers.input_ids[:size], self.buffers.positions[:size])

    @abstractmethod
    def capture(self) -> None:
        """Prepare every size (called once, before the first step)."""

    @abstractmethod
    def run(self, md: AttentionMetadata) -> torch.Tensor:
        """The hidden states [md.num_tokens, hidden] of the step loaded into the buffers, where
        ``md`` is what :meth:`DecodeStepBuffers.load` returned for a captured size."""


class EagerGraphRunner(GraphRunner):
    """The reference twin: every "replay" is an eager forward on the buffers."""

    def capture(self) -> None:
        pass

    def run(self, md: AttentionMetadata) -> torch.Tensor:
        if md.num_tokens not in self.sizes:
            raise ValueError(f"size {md.num_tokens} is not a capture size {self.sizes}")
        return self.forward_once(md)


class CudaGraphRunner(GraphRunner):
    """torch.cuda.CUDAGraph per size, one shared memory pool."""

    def __init__(self, model: nn.Module, buffers: DecodeStepBuffers,
                 sizes: tuple[int, ...], ep_size: int | None = None) -> None:
        super().__init__(model, buffers, sizes, ep_size)
        if buffers.device.type != "cuda":
            raise ValueError("CUDA graphs need the step buffers on a CUDA device")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            md = self.buffers.metadata(size)  # all padding rows: the runs write no KV
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self.forward_once(md)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.forward_once(md)
            except RuntimeError as err:
                raise RuntimeError(
                    f"capturing the decode step of {size} rows failed (a layer synchronises "
                    f"with the host or allocates on it); run with --enforce-eager: {err}"
                ) from err
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("Captured %d decode CUDA graphs (sizes %s)", len(self.graphs), self.sizes)

    def run(self, md: AttentionMetadata) -> torch.Tensor:
        size = md.num_tokens
        graph = self.graphs.get(size)
        if graph is None:
            raise ValueError(f"no graph captured for {size} rows (sizes {self.sizes})")
        graph.replay()
        return self.outputs[size]


def make_graph_runner(model: nn.Module, buffers: DecodeStepBuffers, sizes: tuple[int, ...],
                      ep_size: int | None = None, eager: bool = False) -> GraphRunner:
    """CUDA graphs where the buffers are on a GPU; the eager twin when asked or on the CPU."""
    if eager or buffers.device.type != "cuda":
        return EagerGraphRunner(model, buffers, sizes, ep_size)
    return CudaGraphRunner(model, buffers, sizes, ep_size)


def replayable(moe_layers: list[nn.Module], counts: tuple[int, ...]) -> bool:
    """Whether a step whose ranks run ``counts`` rows may replay a graph: every MoE layer's
    exchange is one a graph records (always true on one rank)."""
    return all(m.dispatcher.capturable(counts, m.top_k) for m in moe_layers)


def capturable_sizes(sizes: tuple[int, ...], moe_layers: list[nn.Module],
                     ep_size: int | None) -> tuple[int, ...]:
    """The capture sizes whose steps a graph can record (see :func:`replayable`): under
    expert parallelism a size above what the fixed-capacity exchange takes is left eager."""
    if ep_size is None:
        return sizes
    return tuple(s for s in sizes if replayable(moe_layers, (s,) * ep_size))


def build_decode_graphs(model: nn.Module, sizes: tuple[int, ...], moe_layers: list[nn.Module],
                        ep_size: int | None, max_blocks: int, block_size: int,
                        device: str | torch.device, in_place_decode: bool,
                        eager: bool = False) -> GraphRunner | None:
    """A graph per capture size for decode-only steps, captured (None: no size can be).

    On a CUDA device this records CUDA graphs; ``eager`` (or a CPU device) builds the reference
    twin that runs the same buffers eagerly, which is how the tests check them. Under expert
    parallelism only the sizes whose MoE exchanges a graph can record (:func:`capturable_sizes`);
    every rank captures the same sizes in the same order, so the capture runs' collectives line
    up. ``max_blocks``: the block-table width (``cdiv(max_model_len, block_size)``);
    ``in_place_decode``: the attention backend reads the paged cache in place, which graph
    steps need (their shapes must not depend on the contexts)."""
    sizes = capturable_sizes(sizes, moe_layers, ep_size)
    if not sizes:
        logger.info("Decode steps run eagerly: this all-to-all backend cannot be captured")
        return None
    if not in_place_decode:
        raise ValueError("decode graphs need decode attention that reads the cache in place")
    buffers = DecodeStepBuffers(max(sizes), max_blocks, block_size, device)
    runner = make_graph_runner(model, buffers, sizes, ep_size, eager)
    runner.capture()
    return runner
