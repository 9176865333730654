"""The result JSON of ``widellm bench serve``: the keys ``vllm bench serve`` writes
(vllm/benchmarks/serve.py: ``main_async`` and ``benchmark``), in its order, then widellm's
own; and the file it goes to, named as vLLM names it."""

from __future__ import annotations

import argparse
import json
import math
import os

from widellm.bench.serve_metrics import BenchmarkMetrics, RequestRecord, latency_dict

DATE_FORMAT = "%Y%m%d-%H%M%S"
# Per-request arrays written only with --save-detailed, as in vLLM (they grow with the run).
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls",
                 "generated_texts", "errors")


def build_result(
    args: argparse.Namespace, *, date: str, model_id: str, tokenizer_id: str | None,
    records: list[RequestRecord], metrics: BenchmarkMetrics,
) -> dict:
    """The result dict for a run of ``args`` (resolved by ``serve_args.resolve_args``)."""
    result: dict = {
        "date": date,
        "endpoint_type": args.backend,  # vLLM keeps this older name beside "backend"
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": args.num_prompts,
        **args.metadata_items,
        # JSON has no infinity; vLLM writes the string.
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration": metrics.duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
    }
    if args.save_detailed:
        result.update({
            "input_lens": [r.prompt_len for r in records],
            "output_lens": metrics.output_lens,
            "start_times": [r.start_time for r in records],
            "ttfts": [r.ttft for r in records],
            "itls": [r.itl for r in records],
            "generated_texts": [r.generated_text for r in records],
            "errors": [r.error for r in records],
        })
    result.update({
        # Small enough to keep without --save-detailed, as vLLM does.
        "latencies": [r.latency for r in records],
        "queue_times": [r.queue_time for r in records],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "rtfx": 0.0,  # vLLM's speech-input speed; no audio here
        **latency_dict(metrics, args.selected_metrics),
        # widellm's own keys.
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "dataset_name": args.dataset_name,
        "seed": args.seed,
        "num_warmups": args.num_warmups,
        "ignore_eos": args.ignore_eos or args.fixed_output_len,
        "fixed_output_len": args.fixed_output_len,
        "token_id_prompts": args.token_id_prompts,
        "goodput_slos_ms": args.goodput_slos or None,
        "percentiles": list(args.percentiles),
    })
    return result


def result_path(args: argparse.Namespace, model_id: str, date: str) -> str | None:
    """Where the result goes: ``--output-json``; else, with --save-result or
    --append-result, ``--result-filename`` or vLLM's
    ``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json``, inside ``--result-dir``."""
    if args.output_json:
        return args.output_json
    if not (args.save_result or args.append_result):
        return None
    concurrency = (f"-concurrency{args.max_concurrency}"
                   if args.max_concurrency is not None else "")
    name = args.result_filename or (
        f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-"
        f"{model_id.rstrip('/').split('/')[-1]}-{date}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def write_result(path: str, result: dict, append: bool = False) -> None:
    """Write ``result`` to ``path``; appending puts it on a line of its own."""
    with open(path, "a+" if append else "w", encoding="utf-8") as f:
        if append and f.tell():
            f.write("\n")
        json.dump(result, f, indent=None if append else 2)
