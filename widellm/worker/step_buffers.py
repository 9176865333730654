"""Persistent device buffers for decode steps: what a captured CUDA graph reads.

A CUDA graph replays fixed kernels on fixed addresses, so a decode step's inputs cannot be
fresh tensors: they are copied into buffers allocated once, at the largest capture size, and
every graph (one per size, :mod:`widellm.worker.graph_buckets`) reads the first ``size`` rows.
The metadata a graph sees is the fixed-shape decode form: every row a decode that reads the
paged cache in place, ``num_decodes == num_tokens == size``. A step of ``n < size`` rows fills
rows ``[n, size)`` as padding: token 0 at position 0, cache slot -1 (nothing stored), context
length 0 (attention returns zeros; the kernels read no block), block-table row 0, and
``padding_mask`` True (expert id -1 in the MoE layers).

Tokens sampled by the previous step stay on the device: :meth:`DecodeStepBuffers.load` takes
each row's input token from the previous step's sampled-id tensor where the row sampled
there (one gather on the device), so a step's inputs do not wait for the host to learn what
was sampled. The host's copy of the token (the runner's request state) is the reference twin
that the tests compare against.
"""

from __future__ import annotations

import torch

from widellm.layers.attention_metadata import AttentionMetadata
from widellm.worker.input_batch import BatchInputs
from widellm.worker.sampled_ids import DeviceSampledIds

# The token and position of a padding row (any valid values; its output is never read).
PAD_TOKEN_ID = 0
PAD_POSITION = 0
# Context length of a padding row: attention reads nothing and writes zeros.
PAD_SEQ_LEN = 0


class DecodeStepBuffers:
    """The step inputs of decode steps up to ``max_rows`` rows, allocated once on ``device``.

    Args:
        max_rows: the largest capture size.
        max_blocks: block-table width (``cdiv(max_model_len, block_size)``): fixed, so a
            graph's block-table view never changes shape.
        block_size: tokens per KV block.
        device: where the buffers live (the engine's device).
    """

    def __init__(self, max_rows: int, max_blocks: int, block_size: int,
                 device: str | torch.device = "cpu") -> None:
        if max_rows < 1 or max_blocks < 1:
            raise ValueError(f"decode buffers need rows and blocks, got {max_rows} x {max_blocks}")
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(max_rows, **i64)
        self.positions = torch.zeros(max_rows, **i64)
        self.slot_mapping = torch.full((max_rows,), -1, **i64)
        self.block_table = torch.zeros(max_rows, max_blocks, **i64)
        self.seq_lens = torch.zeros(max_rows, **i64)
        self.padding_mask = torch.ones(max_rows, dtype=torch.bool, device=self.device)

    def metadata(self, size: int, num_actual: int | None = None) -> AttentionMetadata:
        """The fixed-shape decode metadata of a graph of ``size`` rows: views of the buffers.
        ``num_actual`` (the rows before the padding) lets the CPU store skip the padding rows;
        the device kernels skip slot -1 themselves and never read it."""
        return AttentionMetadata(
            num_tokens=size,
            slot_mapping=self.slot_mapping[:size],
            num_decodes=size,
            decode_slots=None,
            decode_mask=None,
            prefills=[],
            decode_block_table=self.block_table[:size],
            decode_seq_lens=self.seq_lens[:size],
            padding_mask=self.padding_mask[:size],
            num_actual_tokens=size if num_actual is None else num_actual,
        )

    def load(self, batch: BatchInputs, slot_mapping: torch.Tensor, size: int,
             prev_sampled: DeviceSampledIds | None = None) -> AttentionMetadata:
        """Copy a decode-only ``batch`` of ``n <= size`` rows into rows ``[0, n)``, pad rows
        ``[n, size)``, and return :meth:`metadata` for ``size``.

        Args:
            batch: a decode-only batch (every query length 1).
            slot_mapping: ``[n]`` int64 cache slot of each row's token (host).
            size: the capture size the step runs at.
            prev_sampled: the previous step's sampled ids on the device; a row whose request
                sampled there takes its input token from it.

        Raises:
            ValueError: a prompt-carrying batch, or more rows than ``size`` / the buffers hold,
                or a context longer than the block table.
        """
        n = len(batch.req_ids)
        if size > self.max_rows or n > size:
            raise ValueError(f"{n} rows at size {size}: the buffers hold {self.max_rows}")
        if n and int(batch.query_lens.max()) != 1:
            raise ValueError("decode buffers take decode-only batches")
        width = batch.block_table.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"block table of {width} blocks > the buffers' {self.max_blocks}")
        dev = self.device
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(batch.positions), non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.block_table[:n, :width].copy_(torch.from_numpy(batch.block_table), non_blocking=True)
        self.block_table[:n, width:].zero_()
        self.seq_lens[:n].copy_(torch.from_numpy(batch.context_lens), non_blocking=True)
        self.padding_mask[:n].fill_(False)
        if prev_sampled is not None:
            rows = [(i, prev_sampled.index_of[r]) for i, r in enumerate(batch.req_ids)
                    if r in prev_sampled.index_of]
            if rows:
                dst, src = (torch.tensor(c, dtype=torch.int64).to(dev, non_blocking=True)
                            for c in zip(*rows))
                self.input_ids.index_copy_(0, dst, prev_sampled.token_ids.index_select(0, src))
        self.input_ids[n:size].fill_(PAD_TOKEN_ID)
        self.positions[n:size].fill_(PAD_POSITION)
        self.slot_mapping[n:size].fill_(-1)
        self.block_table[n:size].zero_()
        self.seq_lens[n:size].fill_(PAD_SEQ_LEN)
        self.padding_mask[n:size].fill_(True)
        return self.metadata(size, n)
