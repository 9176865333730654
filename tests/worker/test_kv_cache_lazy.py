"""The KV pool is zero by construction and mapped lazily: allocating it and warming the
engine up leaves it without resident pages; only blocks a request writes become resident."""

from __future__ import annotations

import mmap

import pytest
import torch

from widellm.engine.arg_utils import EngineArgs
from widellm.engine.engine_core import EngineCore, EngineCoreRequest
from widellm.sampling_params import SamplingParams
from widellm.worker.kv_cache import lazy_zeros

NUM_BLOCKS = 2048  # 32 MiB per llama-tiny fp32 pool: plenty of pages to tell apart
PAGE = mmap.PAGESIZE


# /proc/self/pagemap: one 64-bit entry per page; bit 63 = present, bit 56 = mapped by this
# process only (pages only read map the kernel's shared zero page, which is not exclusive).
PAGEMAP_ENTRY = 8
PRESENT, EXCLUSIVE = 1 << 63, 1 << 56


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of t's (page-aligned) storage backed by pages of its own, from pagemap."""
    addr, size = t.data_ptr(), t.untyped_storage().nbytes()
    assert addr % PAGE == 0
    pages = -(-size // PAGE)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // PAGE * PAGEMAP_ENTRY)
        raw = f.read(pages * PAGEMAP_ENTRY)
    entries = memoryview(raw).cast("Q")
    return sum(PAGE for e in entries if e & PRESENT and e & EXCLUSIVE)


def test_lazy_zeros_reads_zero_and_maps_only_written_pages():
    t = lazy_zeros((64, PAGE // 4), torch.float32)  # one page per row
    assert t.shape == (64, PAGE // 4) and t.dtype == torch.float32
    assert resident_bytes(t) == 0
    assert int(t.count_nonzero()) == 0  # reading maps the shared zero page, not ours
    assert resident_bytes(t) == 0
    t[5] = 1.0
    t[9, 3] = 2.0
    assert resident_bytes(t) == 2 * PAGE
    assert float(t.sum()) == PAGE // 4 + 2.0


@pytest.fixture(scope="module")
def core(model_dir):
    args = EngineArgs(model=model_dir("LlamaForCausalLM"), dtype="float32", max_model_len=256,
                      num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=256, max_num_seqs=8)
    core = EngineCore(args.create_engine_config())
    yield core
    core.shutdown()


def test_warmup_leaves_the_pool_unmapped_and_a_request_maps_only_its_blocks(core):
    caches = core.model_runner.kv_caches
    pool_bytes = sum(c.untyped_storage().nbytes() for c in caches)
    assert pool_bytes == NUM_BLOCKS * core.model_runner.kv_spec.bytes_per_block
    # __init__ ran the warm-up batches (the full prefill and decode shapes).
    assert [resident_bytes(c) for c in caches] == [0] * len(caches)
    # Nor do the idle-time batches: a lockstep rank's dummy batch and the padded-size warm-up.
    core.model_runner.execute_dummy_batch()
    core.model_runner.warm_next_size()
    assert [resident_bytes(c) for c in caches] == [0] * len(caches)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    core.add_request(EngineCoreRequest("r0", list(range(1, 21)), params, [], 4, 0.0))
    while core.has_unfinished_requests():
        core.step()
    # 24 tokens: 2 blocks, written in each layer's K and V halves.
    resident = sum(resident_bytes(c) for c in caches)
    bytes_per_block = core.model_runner.kv_spec.bytes_per_block
    assert 0 < resident <= 2 * bytes_per_block + 4 * len(caches) * PAGE
    assert resident < pool_bytes // 100
