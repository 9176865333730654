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

from widellm.eplb.config import EPLBConfig  # noqa: F401 - part of the engine config
from widellm.json_flags import parse_json_object
from widellm.kv_transfer.config import KVTransferConfig

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


def auto_dtype() -> torch.dtype:
    """What ``--dtype auto`` runs: bf16 where the CPU computes bf16 matmuls natively
    (AVX512-BF16 or AMX, as oneDNN reports), fp32 elsewhere. fp16 is slow on CPUs either way.
    On an AVX2 CPU (AMD EPYC Zen 3) bf16 matmuls are emulated: SmolLM2's projections ran 6-12x
    slower than fp32 at decode batch sizes, and vLLM's CPU server 3.7x slower end to end."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is None or bool(check()):
        return torch.bfloat16
    return torch.float32


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype()
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What to run. ``model`` is a folder, a .gguf file, or a ``preset:`` name (already resolved
    to a path by the time this is built; ``served_name`` keeps what the user typed, or the
    first --served-model-name; ``extra_served_names`` are the others the API answers to)."""

    model: str
    served_name: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    tokenizer: str
    seed: int = 0
    # Resolved attention backend (layers/attention_backend.py): "cpu" or "triton".
    attention_backend: str = "cpu"
    extra_served_names: tuple[str, ...] = ()

    @property
    def served_names(self) -> list[str]:
        """Every name the API answers to, the reported one first."""
        return [self.served_name, *self.extra_served_names]

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
    """Paged KV cache (see engine/kv_budget.py). ``num_kv_blocks`` fixes the block count (tests
    use it to force preemption); else ``kv_cache_memory`` bytes per rank (vLLM's meaning);
    else as many blocks as ``max_num_seqs`` full-length requests use, capped by this rank's
    share of ``kv_cache_memory_fraction`` of the memory available at start-up: on CPU the
    local ranks split one host budget, on GPU each rank takes the fraction of its device."""

    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.25
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # Not a flag: the host's available memory in bytes as the launcher of this machine's ranks
    # measured it once before starting them (None: the rank measures it itself). One reading
    # for all local ranks, so their shares add up to one budget.
    host_available_memory: int | None = None

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
        if self.host_available_memory is not None and self.host_available_memory < 0:
            raise ValueError(
                f"host_available_memory must be >= 0, got {self.host_available_memory}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Token budget per step and batch size. With chunked prefill (the default) one rule
    covers all tokens and any prompt may be split across steps."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 4096
    # Off: a waiting prompt is admitted only when all of its uncached tokens fit the step's
    # remaining budget (vLLM's --no-enable-chunked-prefill).
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while step N runs, with placeholders for its sampled tokens.
    async_scheduling: bool = False
    # Steps that carry prompt tokens run padded to a multiple of this many tokens, capped at
    # max_num_batched_tokens (0: never).
    # oneDNN builds a GEMM kernel for every new row count, 14-35 ms per step for SmolLM2
    # (docs/BENCHMARKS.md); padding bounds the row counts to a set that a server warms while
    # idle (ModelRunner.warm_next_size).
    prefill_pad_multiple: int = 0
    # Decode-only steps run padded to the smallest of these row counts that holds them
    # (vLLM's CUDA graph capture sizes: the CUDA runner captures one graph per size); a larger
    # step runs as it is. Empty: no padding (the CPU default; given explicitly, a CPU engine
    # pads the same way, which is how the tests check the padding).
    cudagraph_capture_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        sizes = self.cudagraph_capture_sizes
        if any(s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"cuda_graph_sizes must be increasing positive row counts, got "
                             f"{list(sizes)}")
        if self.prefill_pad_multiple < 0:
            raise ValueError(
                f"prefill_pad_multiple must be >= 0, got {self.prefill_pad_multiple}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Else a prompt longer than the budget could never be scheduled.
            raise ValueError(
                f"without chunked prefill every prompt must fit one step: "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}); raise --max-num-batched-tokens or "
                f"lower --max-model-len")


# The automatic prefill_pad_multiple: at most this many padded sizes up to the step budget
# (the idle warm-up builds each one's kernels), in whole AMX tiles of rows.
PREFILL_PAD_SIZES = 64
AMX_TILE_ROWS = 16


def default_prefill_pad_multiple(max_num_batched_tokens: int) -> int:
    """2,048 -> 32, 4,096 -> 64, 512 -> 16: the budget over PREFILL_PAD_SIZES, rounded up to
    whole AMX tiles."""
    per_size = -(-max_num_batched_tokens // PREFILL_PAD_SIZES)
    return -(-per_size // AMX_TILE_ROWS) * AMX_TILE_ROWS


# Dispatch/combine backends of expert-parallel MoE layers (see layers/moe/registry.py).
ALL2ALL_BACKENDS = ("allgather_reducescatter", "all2all", "all2all_fixed", "auto")
# Dual-batch overlap: never, on every step the thresholds allow, or per step where measured
# faster on this deployment (see engine/dbo_policy.py).
DBO_MODES = ("off", "on", "auto")
# Who starts the ranks: processes of each machine (mp), or Ray actors the frontend places on
# a Ray cluster's nodes, setting each one's node-local size itself (engine/ray_launcher.py).
DP_BACKENDS = ("mp", "ray")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Data-parallel ranks (one engine core each) and expert parallelism over all of them.

    A deployment of ``data_parallel_size`` ranks may span machines: each machine runs
    ``data_parallel_size_local`` ranks starting at ``data_parallel_start_rank``; the ranks and
    the frontend meet at ``data_parallel_address:data_parallel_rpc_port`` (the frontend's
    machine). ``data_parallel_rpc_port`` None means every rank is local and talks over IPC.
    ``data_parallel_rank`` is set per engine-core process (None in the frontend).
    """

    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int | None = None
    data_parallel_rank: int | None = None
    data_parallel_backend: str = "mp"
    enable_expert_parallel: bool = False
    all2all_backend: str = "all2all"
    # Rows per (source, destination) rank pair of the all2all_fixed buffers; None sizes them
    # for any decode step (max_num_seqs x min(top_k, experts per rank)); larger batches spill.
    all2all_fixed_capacity: int | None = None
    # Seconds a collective may block before the rank gives up (a peer died or hung).
    distributed_timeout_s: float = 120.0
    # Dual-batch overlap (one of DBO_MODES): split a step into two micro-batches whose MoE
    # communication overlaps the other's compute, when every rank's batch reaches the
    # threshold of its kind (a batch of decodes only, or one with prompt tokens).
    enable_dbo: str = "off"
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    # Seconds the frontend waits for every engine core to load its model and report ready.
    # Loading a large checkpoint can take minutes; a core silent for this long is dead.
    engine_ready_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.engine_ready_timeout_s <= 0:
            raise ValueError(
                f"engine_ready_timeout_s must be > 0, got {self.engine_ready_timeout_s}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        local = self.local_size
        if local < 1 or self.data_parallel_start_rank < 0 or (
            self.data_parallel_start_rank + local > self.data_parallel_size
        ):
            raise ValueError(
                f"data_parallel_size_local={local} from data_parallel_start_rank="
                f"{self.data_parallel_start_rank} does not fit data_parallel_size="
                f"{self.data_parallel_size}"
            )
        if self.data_parallel_backend not in DP_BACKENDS:
            raise ValueError(f"data_parallel_backend must be one of {DP_BACKENDS}")
        # Ray ranks always reach the frontend over TCP (a free port unless one is given).
        if (local < self.data_parallel_size and self.data_parallel_rpc_port is None
                and self.data_parallel_backend != "ray"):
            raise ValueError(
                "data_parallel_rpc_port is required when ranks run on more than one machine "
                "(data_parallel_size_local < data_parallel_size)"
            )
        if self.data_parallel_rank is not None and not (
            0 <= self.data_parallel_rank < self.data_parallel_size
        ):
            raise ValueError(f"data_parallel_rank {self.data_parallel_rank} out of range")
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(
                f"all2all_backend must be one of {ALL2ALL_BACKENDS}, got {self.all2all_backend!r}"
            )
        if self.all2all_fixed_capacity is not None and self.all2all_fixed_capacity < 1:
            raise ValueError(
                f"all2all_fixed_capacity must be >= 1, got {self.all2all_fixed_capacity}"
            )
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if self.enable_dbo not in DBO_MODES:
            raise ValueError(f"enable_dbo must be one of {DBO_MODES}, got {self.enable_dbo!r}")
        if self.enable_dbo != "off" and not self.needs_lockstep:
            raise ValueError("enable_dbo needs --enable-expert-parallel over more than one rank "
                             "(--data-parallel-size > 1): it overlaps the experts' all-to-all")
        for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2 (two non-empty micro-batches), "
                                 f"got {getattr(self, name)}")

    @property
    def local_size(self) -> int:
        """Ranks run on this machine."""
        return self.data_parallel_size_local or (
            self.data_parallel_size - self.data_parallel_start_rank
        )

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the routed experts are split over (1 without --enable-expert-parallel)."""
        return self.data_parallel_size if self.enable_expert_parallel else 1

    @property
    def needs_lockstep(self) -> bool:
        """Every MoE forward is a collective across the EP group, so all ranks must step."""
        return self.expert_parallel_size > 1


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """What the engine measures about itself beyond the always-on metrics."""

    # Time every step's phases (scheduling, attention/dense, experts, MoE communication,
    # dummy batches, lockstep waits); see step_timer.py. Off by default: it adds a clock
    # read per phase per layer.
    collect_step_breakdown: bool = False
    # A request in flight that gets no token for this many seconds is logged as stalled with
    # the engine core's state and counted in widellm:request_stalls (0: off). A loaded CPU
    # server's longest honest gap is a long prefill step, tens of seconds at most.
    request_stall_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.request_stall_timeout_s < 0:
            raise ValueError(
                f"request_stall_timeout_s must be >= 0, got {self.request_stall_timeout_s}")


# Grammar engines for structured outputs ("auto" picks xgrammar, the only one so far).
STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """How requests with a structured output (JSON schema, regex, choice, grammar) are
    constrained: the grammar engine, and whether JSON may contain free whitespace (a
    request can ask for compact JSON itself too)."""

    backend: str = "auto"
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs_config: backend must be one of "
                             f"{', '.join(STRUCTURED_OUTPUT_BACKENDS)}, got {self.backend!r}")

    @classmethod
    def parse(cls, value: "str | dict | None") -> "StructuredOutputsConfig":
        """From ``--structured-outputs-config`` JSON (or a dict); None gives the defaults."""
        if value is None:
            return cls()
        return cls(**parse_json_object(value, "structured_outputs_config",
                                       ("backend", "disable_any_whitespace")))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    observability_config: ObservabilityConfig = ObservabilityConfig()
    eplb_config: EPLBConfig = EPLBConfig()
    # Disaggregated prefill/decode: this instance's KV connector (None: colocated).
    kv_transfer_config: KVTransferConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    # Where weights, KV cache and activations live: "cpu" or "cuda" (widellm/device.py).
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' once resolved, got {self.device!r}")
        if self.eplb_config.enable_eplb and not self.parallel_config.needs_lockstep:
            raise ValueError("enable_eplb needs --enable-expert-parallel over more than one "
                             "rank (--data-parallel-size > 1)")

    @property
    def on_cuda(self) -> bool:
        """Whether the engine's tensors (weights, KV cache, activations) live on a GPU."""
        return self.device == "cuda"

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
