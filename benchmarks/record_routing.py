"""Record a real widellm run's expert routing, per MoE layer, for ``widellm simulate
--expert-skew recorded:FILE``::

    .venv/bin/python benchmarks/record_routing.py --model preset:deepseek-v3-tiny-skewed \\
        --output routing.json [--num-prompts 16 --prompt-len 64 --max-tokens 32]

It serves random-token prompts with the offline ``LLM`` on one rank and counts, in every MoE
layer, how many tokens picked each (logical) expert. The engine's own EPLB recorder
(``widellm/eplb/stats.py``) counts *physical* slots over a sliding window and only on
expert-parallel ranks with EPLB on, so this script wraps each ``FusedMoE.route`` instead: the
ids it returns on one rank without EPLB are the router's logical choices (padding rows are
-1 and skipped). The counts cover prefill and decode tokens alike.

Output (JSON, or a torch file for a ``.pt`` name)::

    {"format": "widellm.routing_counts.v1", "model": ..., "num_experts": E, "top_k": k,
     "num_tokens": [tokens routed per layer], "counts": [[E counts] per MoE layer]}
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from widellm import LLM, SamplingParams
from widellm.layers.moe.layer import FusedMoE
from widellm.eplb.load_file import ROUTING_COUNTS_FORMAT

DEFAULT_MODEL = "preset:deepseek-v3-tiny-skewed"
# Ids below this are the presets' special tokens; random prompts avoid them.
FIRST_PROMPT_ID = 3


class RouteCounter:
    """Per-layer expert counts, filled by wrapping each MoE layer's ``route``."""

    def __init__(self, layers: list[FusedMoE]) -> None:
        self.num_experts = layers[0].num_experts
        self.top_k = layers[0].top_k
        self.counts = torch.zeros(len(layers), self.num_experts, dtype=torch.int64)
        for index, layer in enumerate(layers):
            if layer.placement is not None:
                raise ValueError("record on one rank without EPLB: its ids are logical")
            layer.route = self._wrap(layer.route, index)

    def _wrap(self, route, index: int):
        def counted_route(*args, **kwargs):
            weights, ids = route(*args, **kwargs)
            flat = ids.reshape(-1)
            flat = flat[flat >= 0].cpu()
            self.counts[index] += torch.bincount(flat, minlength=self.num_experts)
            return weights, ids
        return counted_route


def moe_layers(llm: LLM) -> list[FusedMoE]:
    core = llm.llm_engine.engine_core
    if core is None:
        raise ValueError("record with one rank: the engine core must run in this process")
    layers = [m for m in core.model_runner.model.modules() if isinstance(m, FusedMoE)]
    if not layers:
        raise ValueError("the model has no MoE layers")
    return layers


def record(args: argparse.Namespace) -> dict:
    llm = LLM(args.model, seed=args.seed, enforce_eager=True)
    try:
        counter = RouteCounter(moe_layers(llm))
        vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
        rng = np.random.default_rng(args.seed)
        prompts = rng.integers(FIRST_PROMPT_ID, vocab, size=(args.num_prompts, args.prompt_len))
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate([p.tolist() for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    counts = counter.counts
    return {
        "format": ROUTING_COUNTS_FORMAT, "model": args.model, "num_experts": counter.num_experts,
        "top_k": counter.top_k, "num_tokens": (counts.sum(1) // counter.top_k).tolist(),
        "counts": counts.tolist(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--output", required=True, help="JSON file (or .pt for torch.save)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = record(args)
    if args.output.endswith((".pt", ".pth")):
        torch.save(result, args.output)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(result, f)
    per_layer = np.asarray(result["counts"], dtype=np.float64)
    hottest = (per_layer.max(1) / per_layer.sum(1) * result["top_k"]).round(3).tolist()
    print(f"wrote {args.output}: {len(result['counts'])} MoE layers, {result['num_experts']} "
          f"experts, top-{result['top_k']}; tokens per layer {result['num_tokens']}; "
          f"hottest expert's pick rate per layer {hottest}")


if __name__ == "__main__":
    main()
