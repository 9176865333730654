"""Engine configuration: frozen, slotted dataclasses validated on creation.

Every CLI flag maps one-to-one onto a field here (``--max-num-batched-tokens`` ->
``SchedulerConfig.max_num_batched_tokens``). ``EngineConfig.create`` derives the values that
depend on the model (``max_model_len``) and is the only place that reads the checkpoint config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# "auto" picks bf16 on CPU because its matmuls run on AMX/AVX512-BF16 units; fp16 is slow there.
AUTO_DTYPE = torch.bfloat16


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return AUTO_DTYPE
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What to run. ``model`` is a folder, a .gguf file, or a ``preset:`` name (already resolved
    to a path by the time this is built; ``served_name`` keeps what the user typed)."""

    model: str
    served_name: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    tokenizer: str
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"model {self.model!r}: config.json names no architecture")
        return archs[0]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache. The pool is sized from ``kv_cache_memory`` bytes when given, else from
    ``kv_cache_memory_fraction`` of the memory available at start-up; ``num_kv_blocks`` overrides
    both (tests use it to force preemption)."""

    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.25
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Token budget per step and batch size. Chunked prefill is always on: one rule for all
    tokens, any prompt may be split across steps."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 4096
    # Schedule step N+1 while step N runs, with placeholders for its sampled tokens.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Parallel layout. Only a single rank exists for now; the fields are where data and
    expert parallelism attach."""

    data_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size must be 1 in this build, got {self.data_parallel_size}"
            )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
