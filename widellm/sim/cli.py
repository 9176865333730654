"""``widellm simulate``: run the cluster simulator from flags and/or a config file, print the
report's table, write its JSON and plots.

A config file (``--config FILE.yaml`` or ``.json``) is a mapping of this command's flag names
(dashes or underscores) to values, as for ``widellm serve --config``; a flag given on the
command line wins over the file. Per-pool settings that differ between the prefill and the
decode pool go in ``--prefill-config`` / ``--decode-config`` (JSON objects of ``PoolConfig``
fields, e.g. ``{"dbo": "on", "max_num_seqs": 512}``; mappings in a config file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from widellm.config import ALL2ALL_BACKENDS, DBO_MODES, EPLBConfig
from widellm.engine.eplb_args import eplb_config_arg
from widellm.json_flags import parse_json_object
from widellm.sim import config as sim_config
from widellm.sim.config import PoolConfig, SimulationConfig
from widellm.sim.routing import ExpertRouting, moe_dims
from widellm.sim.workload import POISSON_BURSTINESS, WorkloadSpec, generate_requests

DEFAULT_MODEL = "preset:deepseek-v3-small"
DEFAULT_HARDWARE = "h100"
DEFAULT_NUM_RANKS = 8
DEFAULT_NUM_REQUESTS = 1000
# vLLM bench's random-dataset defaults.
DEFAULT_INPUT_LEN = "fixed:1024"
DEFAULT_OUTPUT_LEN = "fixed:128"
POOL_FIELDS = {f.name for f in dataclasses.fields(PoolConfig)}
LENGTH_HELP = ("tokens: N or fixed:N, uniform:LO-HI, normal:MEAN,STD, lognormal:MEAN,SIGMA "
               "(lengths are rounded and at least 1)")


def _pool_overrides(text: str) -> dict[str, Any]:
    try:
        return parse_json_object(text, "pool config", known=POOL_FIELDS)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", dest="sim_config", default=None, metavar="FILE",
                        help="YAML or JSON mapping of these flags to values (flags win)")
    dep = parser.add_argument_group("deployment")
    dep.add_argument("--model", default=DEFAULT_MODEL,
                     help="a folder with config.json (no weights are read) or preset:NAME")
    dep.add_argument("--hardware", default=DEFAULT_HARDWARE,
                     help="profile: h100, h200, b200, cpu, or a profile JSON file")
    dep.add_argument("--num-ranks", type=int, default=None,
                     help=f"ranks of a colocated deployment (default {DEFAULT_NUM_RANKS})")
    dep.add_argument("--prefill-ranks", type=int, default=None,
                     help="ranks of the prefill pool (disaggregated; with --decode-ranks)")
    dep.add_argument("--decode-ranks", type=int, default=None,
                     help="ranks of the decode pool (disaggregated; with --prefill-ranks)")
    dep.add_argument("--ranks-per-node", type=int, default=sim_config.DEFAULT_RANKS_PER_NODE)
    dep.add_argument("--all2all-backend", choices=ALL2ALL_BACKENDS, default="all2all")
    dep.add_argument("--enable-dbo", choices=DBO_MODES, default="off",
                     help="dual-batch overlap in every pool")
    dep.add_argument("--enable-eplb", action="store_true",
                     help="expert-parallel load balancing in every pool")
    dep.add_argument("--eplb-config", type=eplb_config_arg, default=None,
                     help='EPLB settings as JSON, e.g. {"window_size": 1000, "step_interval": '
                          '3000, "num_redundant_experts": 32}')
    dep.add_argument("--enforce-eager", action="store_true",
                     help="no CUDA graphs: decode steps pay eager launch costs")
    dep.add_argument("--max-num-seqs", type=int, default=sim_config.DEFAULT_MAX_NUM_SEQS)
    dep.add_argument("--max-num-batched-tokens", type=int,
                     default=sim_config.DEFAULT_MAX_NUM_BATCHED_TOKENS)
    dep.add_argument("--num-kv-blocks", type=int, default=None,
                     help="KV blocks per rank (default: what max-num-seqs full-length "
                          "requests use)")
    dep.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                     default=True)
    dep.add_argument("--max-model-len", type=int, default=sim_config.DEFAULT_MAX_MODEL_LEN)
    dep.add_argument("--block-size", type=int, default=sim_config.DEFAULT_BLOCK_SIZE)
    dep.add_argument("--weight-dtype", default=sim_config.DEFAULT_WEIGHT_DTYPE)
    dep.add_argument("--prefill-config", type=_pool_overrides, default=None,
                     help="JSON of PoolConfig fields for the prefill pool only")
    dep.add_argument("--decode-config", type=_pool_overrides, default=None,
                     help="JSON of PoolConfig fields for the decode pool only")
    dep.add_argument("--duration", type=float, default=None,
                     help="stop at this virtual second (default: when all requests finish)")
    dep.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")

    wl = parser.add_argument_group("workload")
    wl.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS)
    wl.add_argument("--input-len", default=DEFAULT_INPUT_LEN, help="prompt " + LENGTH_HELP)
    wl.add_argument("--output-len", default=DEFAULT_OUTPUT_LEN, help="output " + LENGTH_HELP)
    load = wl.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=None,
                      help="open loop: arrivals per second over the deployment (default: "
                           "all at once)")
    load.add_argument("--concurrency-per-rank", type=int, default=None,
                      help="closed loop: requests each rank keeps in flight")
    wl.add_argument("--burstiness", type=float, default=POISSON_BURSTINESS,
                    help="gamma shape of the arrival gaps (1: Poisson)")
    wl.add_argument("--num-prefix-groups", type=int, default=0,
                    help="requests share a prompt prefix with their group (round robin)")
    wl.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens per group")
    wl.add_argument("--expert-skew", default="uniform",
                    help="expert routing: uniform, zipf:S (e.g. zipf:1.2) or recorded:FILE "
                         "(benchmarks/record_routing.py)")
    wl.add_argument("--seed", type=int, default=0)

    out = parser.add_argument_group("output")
    out.add_argument("--output-json", default=None, metavar="FILE")
    out.add_argument("--plot-dir", default=None, metavar="DIR",
                     help="write throughput, latency and balancedness PNGs here")


@dataclass(frozen=True)
class SimInputs:
    """Everything one simulation needs, built from the flags."""

    config: SimulationConfig
    workload: WorkloadSpec
    routing: ExpertRouting
    hf_config: Any


def _eplb(args: argparse.Namespace) -> EPLBConfig:
    return EPLBConfig(enable_eplb=args.enable_eplb, **(args.eplb_config or {}))


def _pool(args: argparse.Namespace, num_ranks: int,
          overrides: dict[str, Any] | None) -> PoolConfig:
    fields = dict(
        num_ranks=num_ranks, ranks_per_node=args.ranks_per_node,
        all2all_backend=args.all2all_backend, dbo=args.enable_dbo, eplb=_eplb(args),
        cuda_graphs=not args.enforce_eager, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    for key, value in (overrides or {}).items():
        # An "eplb" mapping changes only the keys it names.
        fields[key] = (dataclasses.replace(fields["eplb"], **value) if key == "eplb"
                       else value)
    return PoolConfig(**fields)


def build_config(args: argparse.Namespace) -> SimulationConfig:
    disagg = args.prefill_ranks is not None or args.decode_ranks is not None
    if disagg and (args.prefill_ranks is None or args.decode_ranks is None):
        raise ValueError("give both --prefill-ranks and --decode-ranks")
    if disagg and args.num_ranks is not None:
        raise ValueError("--num-ranks is a colocated deployment; a disaggregated one takes "
                         "--prefill-ranks and --decode-ranks")
    if not disagg and (args.prefill_config is not None or args.decode_config is not None):
        raise ValueError("--prefill-config / --decode-config need a disaggregated deployment")
    if disagg:
        pools = {"prefill": _pool(args, args.prefill_ranks, args.prefill_config),
                 "decode": _pool(args, args.decode_ranks, args.decode_config)}
    else:
        pools = {"colocated": _pool(args, args.num_ranks or DEFAULT_NUM_RANKS, None)}
    return SimulationConfig(
        model=args.model, hardware=args.hardware, weight_dtype=args.weight_dtype,
        max_model_len=args.max_model_len, block_size=args.block_size, seed=args.seed,
        duration_s=args.duration, max_steps=args.max_steps, **pools,
    )


def build_inputs(args: argparse.Namespace) -> SimInputs:
    """The simulation's config, workload and routing from parsed flags (ValueError on a
    bad combination)."""
    from widellm.model.loader import load_hf_config, resolve_model_path

    config = build_config(args)
    workload = WorkloadSpec(
        num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
        request_rate=args.request_rate, burstiness=args.burstiness,
        concurrency_per_rank=args.concurrency_per_rank,
        num_prefix_groups=args.num_prefix_groups, prefix_len=args.prefix_len, seed=args.seed,
    )
    hf_config = load_hf_config(resolve_model_path(args.model))
    num_experts, top_k, num_layers = moe_dims(hf_config)
    routing = ExpertRouting.from_spec(args.expert_skew, num_experts, top_k, num_layers,
                                      seed=args.seed)
    return SimInputs(config, workload, routing, hf_config)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Simulate, print the table, write the JSON and plots; returns the JSON summary."""
    from widellm.sim.cluster import default_cost_model_factory, simulate
    from widellm.sim.report import format_table, to_json, write_plots

    inputs = build_inputs(args)
    requests = generate_requests(inputs.workload, inputs.hf_config.vocab_size)
    start = time.perf_counter()
    result = simulate(inputs.config, default_cost_model_factory(inputs.config), requests,
                      inputs.routing, concurrency_per_rank=inputs.workload.concurrency_per_rank)
    if not result.sim_wall_s:
        result.sim_wall_s = time.perf_counter() - start
    summary = to_json(result)
    summary["workload"] = inputs.workload.to_dict()
    summary["routing"] = inputs.routing.to_dict()
    print(format_table(summary))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {args.output_json}")
    if args.plot_dir:
        for path in write_plots(result, args.plot_dir):
            print(f"wrote {path}")
    return summary

