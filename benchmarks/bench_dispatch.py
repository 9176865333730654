"""Dispatch + combine microbenchmark of the expert-parallel MoE backends on gloo ranks.

Spawns ``--ranks`` processes on 127.0.0.1 and, for each backend and each ``--tokens`` count
per rank, times one MoE layer's dispatch and combine: uniform random routing, the expert
computation replaced by a copy of the received rows, outside the timed spans (so only
communication and packing are timed), after warm-up, with a barrier before each iteration::

    .venv/bin/python benchmarks/bench_dispatch.py --ranks 2 --tokens 64 512 4096

``all2all_fixed`` is run twice: with the worst-case capacity ``T * min(top_k, S)``, where no
overflow check is needed (the CUDA-graph configuration), and with ``--capacity`` rows per rank
pair (default: 1.25x the mean load), where the overflow check's all-reduce and host sync run.

Reported per row: median over iterations of the slowest rank's time per layer; bytes the
busiest rank sends plus receives per layer (both directions, traffic to itself excluded; ring
schedules for all-gather and reduce-scatter); effective GB/s = bytes / time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_common import write_result_json

HOST = "127.0.0.1"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BACKENDS = ("allgather_reducescatter", "all2all", "all2all_fixed")
# Default capacity of the checked all2all_fixed run, as a multiple of the mean rows per pair.
DEFAULT_CAPACITY_FACTOR = 1.25
SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 4096], help="per rank")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=None,
                        help="rows per rank pair of the checked all2all_fixed run "
                             f"(default {DEFAULT_CAPACITY_FACTOR}x the mean load)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--output-json", default=None, help="write the results here too")
    args = parser.parse_args(argv)
    if args.experts % args.ranks:
        parser.error("--experts must be a multiple of --ranks")
    return args


def _routing(num_tokens: int, args: argparse.Namespace, rank: int):
    gen = torch.Generator().manual_seed(SEED * 1000 + rank)
    hidden = torch.randn(num_tokens, args.hidden, generator=gen).to(DTYPES[args.dtype])
    scores = torch.rand(num_tokens, args.experts, generator=gen)
    topk_weights, topk_ids = scores.topk(args.top_k, dim=1)
    return hidden, topk_ids, topk_weights


def _wire_bytes(kind: str, counts: torch.Tensor, rank: int, num_tokens_all: list[int],
                args: argparse.Namespace, capacity: int, checked: bool,
                units: torch.Tensor) -> int:
    """Bytes ``rank`` sends + receives in one layer, from the ``[R, R]`` (token, slot) pair
    counts and the ``[R, R]`` (token, rank) unit counts."""
    from widellm.layers.moe.dispatch_ep import RowCodec

    ranks, dtype = args.ranks, DTYPES[args.dtype]
    out_row = args.hidden * dtype.itemsize
    others = [r for r in range(ranks) if r != rank]
    if kind == "allgather_reducescatter":
        row = RowCodec(args.hidden, dtype, num_slots=args.top_k).row_bytes
        max_tokens = max(num_tokens_all)
        # max-T all-reduce, all-gather of packed tokens, fp32 reduce-scatter (ring: R-1 steps).
        return 2 * (ranks - 1) * (8 + max_tokens * row + max_tokens * args.hidden * 4)
    if kind == "all2all":
        # One packed row per (token, rank) unit out, one fp32 partial sum back.
        row = RowCodec(args.hidden, dtype, num_slots=args.top_k).row_bytes
        sent = sum(int(units[rank, d]) + int(units[d, rank]) for d in others)
        return sent * (row + args.hidden * 4) + 2 * (ranks - 1) * 8
    row = RowCodec(args.hidden, dtype).row_bytes
    fixed = 2 * (ranks - 1) * capacity * (row + out_row)
    if not checked:
        return fixed
    spill = sum(max(int(counts[rank, d]) - capacity, 0) + max(int(counts[d, rank]) - capacity, 0)
                for d in others)
    any_spill = bool((counts - capacity).clamp(min=0).sum())
    return fixed + 2 * (ranks - 1) * 8 + spill * (row + out_row) + any_spill * 2 * (ranks - 1) * 8


def _time_layer(dispatcher, batch, args: argparse.Namespace) -> list[float]:
    """Seconds per layer of dispatch (launch + wait) plus combine (launch + wait)."""

    def layer() -> float:
        start = time.perf_counter()
        handle = dispatcher.dispatch_launch(*batch)
        tokens = dispatcher.dispatch_wait(handle)
        dispatched = time.perf_counter()
        # Stand-in for the experts, not timed: a fresh [N, H] output, rows unchanged.
        out = tokens.hidden_states.contiguous()
        restart = time.perf_counter()
        dispatcher.combine_wait(dispatcher.combine_launch(out, handle))
        return (dispatched - start) + (time.perf_counter() - restart)

    for _ in range(args.warmup):
        layer()
    times = []
    for _ in range(args.iters):
        dist.barrier()
        times.append(layer())
    return times


def _worker(rank: int, args: argparse.Namespace, port: int, results_path: str) -> None:
    from widellm.layers.moe import make_dispatcher
    from widellm.distributed.collectives import all_gather_single

    torch.set_num_threads(args.threads)
    timeout = timedelta(seconds=args.timeout_s)
    store = dist.TCPStore(HOST, port, args.ranks, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.ranks, timeout=timeout)
    ranks, per_rank = args.ranks, args.experts // args.ranks
    expert_map = torch.full((args.experts,), -1, dtype=torch.int64)
    expert_map[rank * per_rank:(rank + 1) * per_rank] = torch.arange(per_rank)
    rows = []
    for num_tokens in args.tokens:
        batch = _routing(num_tokens, args, rank)
        # [R, R] pairs each rank sends each rank, for the byte counts.
        mine = torch.bincount(batch[1].reshape(-1) // per_rank, minlength=ranks)
        counts = torch.empty(ranks * ranks, dtype=torch.int64)
        all_gather_single(counts, mine)
        counts = counts.view(ranks, ranks)
        # [R, R] (token, rank) units: a token counts once per rank holding any of its experts.
        needs = torch.zeros(num_tokens, ranks, dtype=torch.int64)
        needs.scatter_(1, batch[1] // per_rank, 1)
        units = torch.empty(ranks * ranks, dtype=torch.int64)
        all_gather_single(units, needs.sum(0))
        units = units.view(ranks, ranks)
        worst = num_tokens * min(args.top_k, per_rank)
        mean = num_tokens * args.top_k / ranks
        checked_capacity = args.capacity or math.ceil(DEFAULT_CAPACITY_FACTOR * mean)
        runs = []
        for backend in args.backends:
            if backend != "all2all_fixed":
                runs.append((backend, backend, {}))
                continue
            runs.append(("all2all_fixed", f"all2all_fixed (C={worst}, no check)",
                         {"capacity": worst, "max_tokens_per_rank": num_tokens}))
            runs.append(("all2all_fixed", f"all2all_fixed (C={checked_capacity}, checked)",
                         {"capacity": checked_capacity}))
        for kind, label, kwargs in runs:
            dispatcher = make_dispatcher(kind, expert_map, group=dist.group.WORLD, **kwargs)
            checked = kind == "all2all_fixed" and not dispatcher.overflow_impossible(args.top_k)
            times = torch.tensor(_time_layer(dispatcher, batch, args), dtype=torch.float64)
            slowest = times.clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            wire = torch.tensor([_wire_bytes(kind, counts, rank, [num_tokens] * ranks, args,
                                             kwargs.get("capacity", 0), checked, units)])
            dist.all_reduce(wire, op=dist.ReduceOp.MAX)
            ms = statistics.median(slowest.tolist()) * 1e3
            rows.append({
                "backend": label, "ranks": ranks, "tokens_per_rank": num_tokens,
                "hidden": args.hidden, "top_k": args.top_k, "experts": args.experts,
                "dtype": args.dtype, "ms_per_layer": ms, "bytes_per_rank": int(wire),
                "gb_per_s": int(wire) / (ms * 1e-3) / 1e9,
            })
    if rank == 0:
        with open(results_path, "w", encoding="utf-8") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _table(rows: list[dict]) -> str:
    lines = [
        "| backend | ranks | tokens/rank | hidden | ms/layer (median) | bytes/rank/layer | GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['ranks']} | {r['tokens_per_rank']} | {r['hidden']} "
            f"| {r['ms_per_layer']:.3f} | {r['bytes_per_rank'] / 2**20:.2f} MiB | {r['gb_per_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The parent hosts the rendezvous store on a port the OS picks: nothing hard-coded.
    store = dist.TCPStore(HOST, 0, args.ranks, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=args.timeout_s))
    with tempfile.TemporaryDirectory() as tmp:
        results_path = os.path.join(tmp, "rows.json")
        # Joins every rank; if one fails, the others are terminated and the error re-raised.
        mp.start_processes(_worker, args=(args, store.port, results_path), nprocs=args.ranks,
                           start_method="spawn")
        with open(results_path, encoding="utf-8") as f:
            rows = json.load(f)
    print(f"top_k={args.top_k} experts={args.experts} dtype={args.dtype} iters={args.iters} "
          f"threads/rank={args.threads}")
    print(_table(rows))
    write_result_json(args.output_json, {"args": vars(args), "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
