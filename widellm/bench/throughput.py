"""``widellm bench throughput``: offline throughput on random token-id prompts, greedy with
``ignore_eos`` so every request yields exactly ``--output-len`` tokens."""

from __future__ import annotations

import argparse
import json
import time

from widellm.bench.datasets import random_token_prompts
from widellm.engine.arg_utils import EngineArgs
from widellm.step_timer import summarize
from widellm.worker.memory import peak_rss_bytes

GIB = 1 << 30


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--output-json", type=str, default=None)
    EngineArgs.add_cli_args(parser)


def _rank_breakdowns(llm) -> tuple[dict[int, dict[str, float]], int]:
    """Step-time breakdown per rank (when collected) and the ranks' summed peak RSS."""
    engine = llm.llm_engine
    if engine.client is None:
        timer = engine.engine_core.step_timer
        return ({0: summarize(timer.totals)} if timer is not None else {}), 0
    raw = engine.client.last_breakdown
    rss = sum(engine.client.peak_rss_bytes.values())
    return {rank: summarize(b) for rank, b in sorted(raw.items())}, rss


def run(args: argparse.Namespace) -> dict:
    from widellm import LLM, SamplingParams

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    prompts = random_token_prompts(args.num_prompts, args.input_len, vocab, args.dataset_seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    per_rank, ranks_rss = _rank_breakdowns(llm)
    client = llm.llm_engine.client
    eplb = client.eplb_stats.get(0) if client is not None else None
    dbo_steps = ({rank: st.num_dbo_steps for rank, st in sorted(client.last_stats.items())}
                 if client is not None else {})
    llm.shutdown()
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(p) for p in prompts)
    result = {
        "model": llm.llm_engine.config.model_config.served_name,
        "num_prompts": len(prompts),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        # The frontend plus every rank's process (ranks run as processes when DP > 1).
        "peak_rss_gib": (peak_rss_bytes() + ranks_rss) / GIB,
        "data_parallel_size": llm.llm_engine.config.parallel_config.data_parallel_size,
    }
    if any(dbo_steps.values()):
        result["dbo_steps"] = dbo_steps
    if eplb is not None:
        result["eplb"] = {
            "initial_balancedness": eplb.initial_balancedness,
            "final_balancedness": eplb.balancedness,
            "num_rebalances": eplb.num_rebalances,
            "max_stall_s": eplb.max_stall_s,
            "history": eplb.history,
        }
        print(f"EPLB: balancedness {eplb.initial_balancedness:.3f} -> {eplb.balancedness:.3f}, "
              f"{eplb.num_rebalances} rebalances, longest stall {eplb.max_stall_s * 1e3:.1f} ms")
    if per_rank:
        result["step_breakdown"] = per_rank
        for rank, b in per_rank.items():
            print(f"rank {rank} step time: " + ", ".join(
                f"{k.removesuffix('_s')} {v:.2f} s" for k, v in b.items()))
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['output_tokens_per_s']:.1f} output tok/s, "
        f"{result['total_tokens_per_s']:.1f} total tok/s, "
        f"peak RSS {result['peak_rss_gib']:.2f} GiB ({elapsed:.1f} s)"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
