"""Engine arguments: one dataclass whose fields are the CLI flags (``max_num_seqs`` <->
``--max-num-seqs``) and the ``LLM(...)`` keyword arguments, turned into an EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field, fields

from widellm.comm_trace import COMM_TRACE_DIR_ENV, trace_dir
from widellm.config import (
    ALL2ALL_BACKENDS, DBO_MODES, CacheConfig, EngineConfig, ModelConfig, ObservabilityConfig,
    ParallelConfig, SchedulerConfig, StructuredOutputsConfig, default_prefill_pad_multiple,
    resolve_dtype,
)
from widellm.config import DP_BACKENDS
from widellm.device import DEVICES, resolve_device
from widellm.engine.eplb_args import EPLB_CONFIG_HELP, eplb_config_arg, resolve_eplb_config
from widellm.kv_transfer.config import KVTransferConfig
from widellm.layers.attention_backend import ATTENTION_BACKENDS, resolve_attention_backend
from widellm.kv_transfer.registry import check_connector_name
from widellm.model.loader import load_hf_config, resolve_model_path
from widellm.worker.graph_buckets import default_capture_sizes
from widellm.model.default_model import DEFAULT_MODEL_NAME

_SIZE_RE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(value: str | int | None) -> int | None:
    """'4GiB' -> 4294967296, '2GB' -> 2000000000, 1024 -> 1024, None -> None."""
    if value is None or isinstance(value, int):
        return value
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"kv_cache_memory: cannot parse size {value!r} (e.g. 4GiB, 512MB)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


def dbo_mode(value: str | bool) -> str:
    """``LLM(enable_dbo=True)`` reads as on, False as off; strings pass as they are."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


@dataclass
class EngineArgs:
    model: str | None = field(default=None, metadata={"help": "model folder, .gguf file or "
                              "preset:NAME (default: SmolLM2-135M-Instruct)"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer folder or .gguf"})
    served_model_name: str | list[str] | None = field(default=None, metadata={
        "help": "the model's names in the API: the first is the one responses report, a "
                "request may use any (default: --model)", "nargs": "+"})
    dtype: str = field(default="auto", metadata={
        "help": "auto (bfloat16 where the CPU has bf16 matmul units, else float32), bfloat16, "
                "float32"})
    seed: int = field(default=0, metadata={
        "help": "seed of unseeded random sampling: each engine core (DP rank) draws from its own "
                "stream, seeded from (seed, rank), so a restart with the same seed repeats it"})
    max_model_len: int | None = field(default=None, metadata={"help": "context length"})
    max_num_batched_tokens: int = field(default=4096, metadata={"help": "token budget/step"})
    max_num_seqs: int = field(default=256, metadata={"help": "requests per step"})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "split a prompt that does not fit a step's token budget over several steps "
                "(on by default, as vLLM's; --no-enable-chunked-prefill schedules each "
                "prompt whole, which needs --max-num-batched-tokens >= --max-model-len)"})
    prefill_pad_multiple: int | None = field(default=None, metadata={
        "help": "pad steps with prompt tokens to a multiple of this many tokens, so oneDNN "
                "sees few GEMM shapes, which a server warms while idle (default: on CPU the "
                "step budget / 64 in whole 16-row tiles, off on GPU; 0: off)"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "never run decode steps as CUDA graphs (and never pad them to graph sizes)"})
    cuda_graph_sizes: str | None = field(default=None, metadata={
        "help": "decode batch sizes captured as CUDA graphs, e.g. '1,2,4,8' (default on GPU: "
                "1, 2, 4 and multiples of 8 up to --max-num-seqs, at most 512; on CPU none: "
                "given, decode steps are padded to them there too)"})
    device: str = field(default="auto", metadata={
        "help": "where the engine computes: cpu, cuda (refused until widellm's CUDA model "
                "runner is finished), auto (today the CPU, also on GPU hosts)",
        "choices": DEVICES})
    attention_backend: str = field(default="auto", metadata={
        "help": "K/V store and decode attention: cpu (widellm's C++ kernels), triton "
                "(the GPU kernels; without a GPU only under TRITON_INTERPRET=1, for tests), "
                "auto (triton with a GPU, else cpu)", "choices": ATTENTION_BACKENDS})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_memory: str | None = field(default=None, metadata={
        "help": "KV cache size of each DP rank, e.g. 4GiB (per rank: N local ranks take N "
                "times this; default: what --max-num-seqs requests of --max-model-len tokens "
                "can use, capped by --kv-cache-memory-fraction)"})
    kv_cache_memory_fraction: float = field(default=0.25, metadata={
        "help": "cap of the default KV cache: this fraction of the memory available at "
                "start-up, shared by all DP ranks of this machine on CPU (each GPU rank: of "
                "its device)"})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "exact KV block count", "aliases": ("--num-gpu-blocks-override",)})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse cached prefixes"})
    async_scheduling: bool = field(default=True, metadata={
        "help": "schedule the next step while the current one runs (on by default; on a "
                "2-core CPU measured 0.97-1.04x of synchronous scheduling, see "
                "docs/BENCHMARKS.md)"})
    # "aliases": vLLM's short forms of the same flags.
    data_parallel_size: int = field(default=1, metadata={
        "help": "engine cores (DP ranks), each with its own scheduler, KV cache and requests",
        "aliases": ("-dp",)})
    data_parallel_size_local: int | None = field(default=None, metadata={
        "help": "DP ranks run on this machine (default: all from --data-parallel-start-rank)",
        "aliases": ("-dpl",)})
    data_parallel_start_rank: int = field(default=0, metadata={
        "help": "first DP rank run on this machine (secondary nodes, with --headless)",
        "aliases": ("-dpr",)})
    data_parallel_address: str = field(default="127.0.0.1", metadata={
        "help": "address of the head node, where the frontend listens for the ranks",
        "aliases": ("-dpa",)})
    data_parallel_rpc_port: int | None = field(default=None, metadata={
        "help": "port of the head node for the ranks' handshake and requests (needed when "
                "ranks span machines; all-local ranks use IPC)", "aliases": ("-dpp",)})
    data_parallel_backend: str = field(default="mp", metadata={
        "help": "how DP ranks start: mp (processes of this machine) or ray (actors placed "
                "on the nodes of a running Ray cluster; pip install 'widellm[ray]')",
        "choices": DP_BACKENDS, "aliases": ("-dpb",)})
    enable_expert_parallel: bool = field(default=False, metadata={
        "help": "shard routed experts over all DP ranks (tokens move by all-to-all)",
        "aliases": ("-ep",)})
    all2all_backend: str = field(default="all2all", metadata={
        "help": "expert-parallel dispatch/combine (auto: the fixed-capacity exchange for "
                "decode steps, the variable one for steps with prompt tokens)",
        "choices": ALL2ALL_BACKENDS})
    all2all_fixed_capacity: int | None = field(default=None, metadata={
        "help": "rows per rank pair of the all2all_fixed buffers (default: enough for any "
                "decode step; larger batches spill through a checked second round); without "
                "CUDA graphs each step moves only the rows its largest rank can need"})
    enable_dbo: str | bool = field(default="off", metadata={
        "help": "dual-batch overlap under expert parallelism: each step runs as two "
                "micro-batches, one's MoE all-to-all overlapping the other's compute; "
                "--enable-dbo turns it on, --enable-dbo auto decides per step from the step "
                "times measured with and without it", "choices": DBO_MODES, "nargs": "?",
        "const": "on"})  # a bare --enable-dbo before a positional model reads it as the mode
    dbo_decode_token_threshold: int = field(default=32, metadata={
        "help": "DBO splits a batch of decodes only when every rank has at least this many "
                "tokens (a rank without work follows the others)"})
    dbo_prefill_token_threshold: int = field(default=512, metadata={
        "help": "DBO splits a batch with prompt tokens when every rank has at least this many"})
    distributed_timeout_s: float = field(default=120.0, metadata={
        "help": "seconds a collective may wait for a peer before the rank fails"})
    engine_ready_timeout_s: float = field(default=600.0, metadata={
        "help": "seconds to wait for the engine cores to load the model and report ready "
                "(the first start's one-time CPU kernel build counts in it)"})
    enable_eplb: bool = field(default=False, metadata={
        "help": "expert-parallel load balancing: replicate and re-place hot experts"})
    eplb_config: str | dict | None = field(default=None, metadata={
        "help": EPLB_CONFIG_HELP, "type": eplb_config_arg})
    eplb_num_redundant_experts: int = field(default=0, metadata={
        "help": "extra physical expert slots for replicas (spread evenly over EP ranks; "
                "--eplb-config's num_redundant_experts)"})
    eplb_window_size: int = field(default=1000, metadata={
        "help": "steps of expert load kept (--eplb-config's window_size)"})
    eplb_step_interval: int = field(default=3000, metadata={
        "help": "steps between rebalances (--eplb-config's step_interval)"})
    eplb_log_balancedness: bool = field(default=False, metadata={
        "help": "log the expert load balancedness every rebalance window (--eplb-config's "
                "log_balancedness)"})
    eplb_min_balancedness_gain: float = field(default=0.05, metadata={
        "help": "apply a new expert placement only if it raises balancedness this much "
                "(--eplb-config's min_balancedness_gain)"})
    kv_transfer_config: str | dict | None = field(default=None, metadata={
        "help": "disaggregated prefill/decode: this instance's KV connector, as JSON: "
                '{"kv_connector": "TCPConnector", "kv_role": "kv_producer|kv_consumer|'
                'kv_both", "kv_load_failure_policy": "recompute|fail", '
                '"kv_connector_extra_config": {...}} (see widellm/kv_transfer)'})
    structured_outputs_config: str | dict | None = field(default=None, metadata={
        "help": 'structured outputs, as JSON: {"backend": "auto|xgrammar", '
                '"disable_any_whitespace": false} (JSON without free whitespace)'})
    collect_step_breakdown: bool = field(default=False, metadata={
        "help": "time each step's phases (attention, experts, MoE communication, idle)"})
    request_stall_timeout_s: float = field(default=60.0, metadata={
        "help": "warn (with the engine core's state) and count widellm:request_stalls when a "
                "request in flight gets no token for this many seconds (0: off)"})

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
        for f in fields(cls):
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            helptext = f.metadata.get("help", "")
            if f.name == "model" and positional_model:
                parser.add_argument("model", nargs="?", default=None, help=helptext)
            elif f.type in ("bool", bool, "bool | None"):
                parser.add_argument(*flags, action=argparse.BooleanOptionalAction,
                                    default=f.default, help=helptext)
            else:
                kind = {"int": int, "float": float, "int | None": int}.get(str(f.type), str)
                extra = {k: f.metadata[k] for k in ("nargs", "const") if k in f.metadata}
                parser.add_argument(*flags, type=f.metadata.get("type", kind),
                                    default=f.default, help=helptext,
                                    choices=f.metadata.get("choices"), **extra)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def served_model_names(self) -> list[str]:
        """--served-model-name as a list (one name or several), default the model as typed."""
        names = self.served_model_name
        if isinstance(names, str):
            names = [names]
        if not names:
            return [self.model or DEFAULT_MODEL_NAME]
        if len(set(names)) != len(names):
            raise ValueError(f"served_model_name: names repeat: {names}")
        return list(names)

    def create_engine_config(self) -> EngineConfig:
        if trace_dir() is not None and not self.collect_step_breakdown:
            raise ValueError(f"{COMM_TRACE_DIR_ENV} is set, but the exchange trace is part of "
                             f"the step breakdown: add --collect-step-breakdown (or unset it)")
        device = resolve_device(self.device)
        on_cuda = device == "cuda"
        path = resolve_model_path(self.model)
        hf_config = load_hf_config(path)
        model_max = getattr(hf_config, "max_position_embeddings", None)
        max_model_len = self.max_model_len or model_max
        if max_model_len is None:
            raise ValueError("max_model_len: the model config gives none; pass --max-model-len")
        if model_max is not None and max_model_len > model_max:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's "
                f"max_position_embeddings={model_max}"
            )
        served_names = self.served_model_names()
        kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if kv_transfer_config is not None:
            check_connector_name(kv_transfer_config)
        model_config = ModelConfig(
            model=path,
            served_name=served_names[0],
            extra_served_names=tuple(served_names[1:]),
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype),
            max_model_len=max_model_len,
            tokenizer=self.tokenizer or path,
            seed=self.seed,
            attention_backend=resolve_attention_backend(self.attention_backend, on_cuda),
        )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=parse_size(self.kv_cache_memory),
                kv_cache_memory_fraction=self.kv_cache_memory_fraction,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                async_scheduling=self.async_scheduling,
                cudagraph_capture_sizes=self._capture_sizes(on_cuda),
                prefill_pad_multiple=(
                    (0 if on_cuda else default_prefill_pad_multiple(self.max_num_batched_tokens))
                    if self.prefill_pad_multiple is None else self.prefill_pad_multiple),
            ),
            parallel_config=ParallelConfig(
                data_parallel_size=self.data_parallel_size,
                data_parallel_size_local=self.data_parallel_size_local,
                data_parallel_start_rank=self.data_parallel_start_rank,
                data_parallel_address=self.data_parallel_address,
                data_parallel_rpc_port=self.data_parallel_rpc_port,
                data_parallel_backend=self.data_parallel_backend,
                enable_expert_parallel=self.enable_expert_parallel,
                all2all_backend=self.all2all_backend,
                all2all_fixed_capacity=self.all2all_fixed_capacity,
                distributed_timeout_s=self.distributed_timeout_s,
                enable_dbo=dbo_mode(self.enable_dbo),
                dbo_decode_token_threshold=self.dbo_decode_token_threshold,
                dbo_prefill_token_threshold=self.dbo_prefill_token_threshold,
                engine_ready_timeout_s=self.engine_ready_timeout_s,
            ),
            eplb_config=resolve_eplb_config(
                self.enable_eplb, self.eplb_config,
                flat={f.name: getattr(self, f.name) for f in fields(self)},
                flat_defaults={f.name: f.default for f in fields(self)}),
            observability_config=ObservabilityConfig(
                collect_step_breakdown=self.collect_step_breakdown,
                request_stall_timeout_s=self.request_stall_timeout_s),
            kv_transfer_config=kv_transfer_config,
            structured_outputs_config=StructuredOutputsConfig.parse(
                self.structured_outputs_config),
            device=device,
        )

    def _capture_sizes(self, on_cuda: bool) -> tuple[int, ...]:
        if self.enforce_eager:
            return ()
        if self.cuda_graph_sizes is None:
            return default_capture_sizes(self.max_num_seqs) if on_cuda else ()
        try:
            return tuple(int(s) for s in str(self.cuda_graph_sizes).split(","))
        except ValueError:
            raise ValueError(f"cuda_graph_sizes: a comma-separated list of row counts, got "
                             f"{self.cuda_graph_sizes!r}") from None

    def replace(self, **changes) -> "EngineArgs":
        return dataclasses.replace(self, **changes)
