"""What to simulate: a model, one or two pools of ranks (colocated, or prefill + decode), the
hardware, and when to stop.

A pool is one lockstep deployment (one ``EngineCore`` per rank, experts sharded over all of
its ranks); its fields are the engine's own flags, so a simulated deployment reads like the
``widellm serve`` command it stands for::

    SimulationConfig(
        model="/path/to/DeepSeek-V3",            # a folder with config.json, or preset:NAME
        hardware="h100",
        colocated=PoolConfig(num_ranks=32, dbo="auto",
                             eplb=EPLBConfig(enable_eplb=True, num_redundant_experts=32)),
    )

``pool_engine_config`` (in ``cluster.py``) turns a pool into the ``EngineConfig`` of each of
its ranks; nothing here builds engine objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from widellm.config import ALL2ALL_BACKENDS, DBO_MODES, EPLBConfig

# Engine defaults the simulator keeps unless a pool says otherwise (vLLM's GPU defaults).
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_BLOCK_SIZE = 64
DEFAULT_RANKS_PER_NODE = 8
DEFAULT_DBO_DECODE_THRESHOLD = 32
DEFAULT_DBO_PREFILL_THRESHOLD = 512
# Bytes per KV element (bf16 KV cache) and per expert weight element (fp8 checkpoint).
DEFAULT_KV_DTYPE_BYTES = 2
DEFAULT_WEIGHT_DTYPE = "fp8"
# EPLB weight moves are priced at this many bytes per second per rank when the cost model
# has no ``weight_move_s`` of its own (an inter-node RDMA link, 400 Gb/s ~ 50 GB/s).
DEFAULT_EPLB_MOVE_BYTES_PER_S = 50e9
# Seconds between the end of a request's prefill and its KV being usable on the decode pool
# when the cost model has no ``kv_transfer_s`` (disaggregated runs only).
DEFAULT_KV_TRANSFER_BYTES_PER_S = 50e9
POOL_KINDS = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class PoolConfig:
    """One pool of lockstep ranks.

    Attributes:
        num_ranks: DP ranks = EP size (one GPU each).
        ranks_per_node: GPUs per node (the all-to-all between nodes uses the slower link).
        all2all_backend: one of ``widellm.config.ALL2ALL_BACKENDS``.
        dbo: dual-batch overlap, ``off``/``on``/``auto`` (the engine's ``--enable-dbo``),
            decided by the engine's own ``DboPolicy`` from the ranks' votes.
        dbo_decode_token_threshold, dbo_prefill_token_threshold: the engine's thresholds.
        eplb: the engine's EPLB flags (window, interval, redundant experts, gain).
        cuda_graphs: decode steps pad to the engine's CUDA-graph sizes
            (``worker/graph_buckets.default_capture_sizes``) and pay graph launch costs.
        max_num_seqs, max_num_batched_tokens: the scheduler's per-step limits, per rank.
        num_kv_blocks: KV blocks per rank; else ``kv_cache_memory`` bytes per rank divided
            by the model's bytes per block; else ``max_num_seqs x ceil(max_model_len /
            block_size)`` (the engine's by-need rule, uncapped).
        kv_cache_memory: bytes of KV cache per rank (see ``num_kv_blocks``).
        enable_prefix_caching: the KV manager's prefix cache.
    """

    num_ranks: int
    ranks_per_node: int = DEFAULT_RANKS_PER_NODE
    all2all_backend: str = "all2all"
    dbo: str = "off"
    dbo_decode_token_threshold: int = DEFAULT_DBO_DECODE_THRESHOLD
    dbo_prefill_token_threshold: int = DEFAULT_DBO_PREFILL_THRESHOLD
    eplb: EPLBConfig = field(default_factory=EPLBConfig)
    cuda_graphs: bool = True
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or self.ranks_per_node < 1:
            raise ValueError(f"num_ranks ({self.num_ranks}) and ranks_per_node "
                             f"({self.ranks_per_node}) must be >= 1")
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(f"all2all_backend must be one of {ALL2ALL_BACKENDS}")
        if self.dbo not in DBO_MODES:
            raise ValueError(f"dbo must be one of {DBO_MODES}, got {self.dbo!r}")
        if self.dbo != "off" and self.num_ranks < 2:
            raise ValueError("dbo needs a pool of more than one rank")
        if self.eplb.enable_eplb and self.num_ranks < 2:
            raise ValueError("eplb needs a pool of more than one rank")
        if self.eplb.load_path or self.eplb.save_path:
            # The simulator prices one MoE layer standing for all; a per-layer file is the
            # engine's (a recorded load is a workload's routing here, not a placement).
            raise ValueError("eplb load_path / save_path are the engine's; the simulator "
                             "does not read or write expert load files")

    @property
    def num_nodes(self) -> int:
        return -(-self.num_ranks // self.ranks_per_node)


@dataclass(frozen=True)
class SimulationConfig:
    """A simulated deployment and run.

    Attributes:
        model: a folder with a HF ``config.json`` or ``preset:NAME`` (resolved by widellm's
            ``resolve_model_path`` / ``load_hf_config``; no weights are loaded).
        hardware: a profile name (``h100``, ``h200``, ``b200``, ``cpu``) or a profile file.
        colocated: the one pool of a colocated deployment, or None.
        prefill, decode: the two pools of a disaggregated deployment (both or neither).
        weight_dtype: the expert/dense weights' dtype (``fp8``, ``bf16``).
        kv_dtype_bytes: bytes per KV-cache element (sizes the KV pool and KV transfers).
        max_model_len: the engine's ``--max-model-len``.
        block_size: KV block size in tokens.
        seed: seeds the routing draws and anything random in the simulation.
        duration_s: stop at this virtual time (None: when every request finished).
        max_steps: stop after this many steps of any pool (None: no limit); a safety net.
        eplb_move_bytes_per_s: prices EPLB weight moves where the cost model does not.
        kv_transfer_bytes_per_s: prices P->D KV transfers where the cost model does not.
    """

    model: str
    hardware: str = "h100"
    colocated: PoolConfig | None = None
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    weight_dtype: str = DEFAULT_WEIGHT_DTYPE
    kv_dtype_bytes: int = DEFAULT_KV_DTYPE_BYTES
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    block_size: int = DEFAULT_BLOCK_SIZE
    seed: int = 0
    duration_s: float | None = None
    max_steps: int | None = None
    eplb_move_bytes_per_s: float = DEFAULT_EPLB_MOVE_BYTES_PER_S
    kv_transfer_bytes_per_s: float = DEFAULT_KV_TRANSFER_BYTES_PER_S

    def __post_init__(self) -> None:
        disagg = self.prefill is not None or self.decode is not None
        if disagg and (self.prefill is None or self.decode is None):
            raise ValueError("a disaggregated deployment needs both a prefill and a decode pool")
        if disagg == (self.colocated is not None):
            raise ValueError("give either a colocated pool or prefill + decode pools")
        if self.max_model_len < 1 or self.block_size < 1 or self.kv_dtype_bytes < 1:
            raise ValueError("max_model_len, block_size and kv_dtype_bytes must be >= 1")

    @property
    def disaggregated(self) -> bool:
        return self.colocated is None

    def pools(self) -> dict[str, PoolConfig]:
        """The pools by kind ("colocated", or "prefill" and "decode"), in request order."""
        if self.colocated is not None:
            return {"colocated": self.colocated}
        return {"prefill": self.prefill, "decode": self.decode}

    @property
    def num_gpus(self) -> int:
        return sum(p.num_ranks for p in self.pools().values())

    def to_dict(self) -> dict:
        """Plain JSON-able form, for ``SimResult.config`` and reports."""
        return dataclasses.asdict(self)
