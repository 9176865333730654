"""CUDA engine == CPU engine (issue 25), run by benchmarks/gpu/check.sh.

Cases, greedy with EOS ignored, 8 prompts of 3-60 tokens, 24 new tokens each:

- tiny Llama, DeepSeek-V3 and Qwen3-MoE in fp32: the CPU engine (the reference) against the
  CUDA engine with decode graphs (vLLM's capture sizes) and with ``--enforce-eager``; tokens
  must be equal (the check fails otherwise). The graph case also reports how much of the run
  replayed graphs (the step breakdown's ``graph_replay``), so a silent fallback shows.
- the tiny DeepSeek-V3 FP8 preset in bf16: CUDA keeping the FP8 weights (W8A8: activations
  quantized per token and 128-column group) against the CPU dequantizing them; reported as the
  share of tokens equal up to each prompt's first divergence, not checked (the activations'
  quantization changes the numbers).

``--device cpu`` runs the same cases with the CPU as the "device" side, its graph case through
the graph runner's eager twin (``WIDELLM_TEST_EAGER_GRAPHS``): how the script is checked on a
machine without a GPU.

Usage: python benchmarks/gpu/engine_parity.py [--device cuda|cpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from device_side import engine_side

NEW_TOKENS = 24
PROMPT_LENS = (3, 7, 12, 20, 28, 36, 47, 60)
EXACT_MODELS = ("preset:llama-tiny", "preset:deepseek-v3-tiny", "preset:qwen3-moe-tiny")
FP8_MODEL = "preset:deepseek-v3-tiny-fp8"
# Capture sizes when the device side is the CPU (a CUDA engine picks vLLM's by default).
CPU_GRAPH_SIZES = "1,2,4,8"


def prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(25)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def generate(model: str, device: str, dtype: str, **kwargs) -> tuple[list[list[int]], dict]:
    """Token ids per prompt, and the run's replay share and wall time."""
    from widellm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    with LLM(model, dtype=dtype, device=device, num_kv_blocks=256, max_model_len=512,
             max_num_seqs=16, collect_step_breakdown=True, **kwargs) as llm:
        vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
        outs = llm.generate(prompts(vocab), params, use_tqdm=False)
        totals = dict(llm.llm_engine.engine_core.step_timer.totals)
    wall = time.perf_counter() - start
    forward = totals.get("forward", 0.0) + totals.get("graph_replay", 0.0)
    info = {"wall_s": round(wall, 2),
            "graph_replay_share": round(totals.get("graph_replay", 0.0) / forward, 3)
            if forward else 0.0}
    return [list(o.outputs[0].token_ids) for o in outs], info


def agreement(got: list[list[int]], ref: list[list[int]]) -> float:
    """Share of reference tokens matched before each prompt's first divergence."""
    same = 0
    for g, r in zip(got, ref):
        for a, b in zip(g, r):
            if a != b:
                break
            same += 1
    return same / max(1, sum(len(r) for r in ref))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    graphs = engine_side(args.device, CPU_GRAPH_SIZES)
    results, ok = [], True
    for model in EXACT_MODELS:
        ref, ref_info = generate(model, "cpu", "float32")
        for name, kwargs in (("graphs", graphs), ("eager", {"enforce_eager": True})):
            got, info = generate(model, args.device, "float32", **kwargs)
            equal = got == ref
            ok &= equal
            results.append({"model": model, "case": name, "equal": equal, **info,
                            "cpu_wall_s": ref_info["wall_s"],
                            "agreement": round(agreement(got, ref), 4)})
            print(json.dumps(results[-1]), flush=True)
    ref, _ = generate(FP8_MODEL, "cpu", "bfloat16")
    got, info = generate(FP8_MODEL, args.device, "bfloat16")
    results.append({"model": FP8_MODEL, "case": "fp8-kept-vs-dequantized", "equal": got == ref,
                    "agreement": round(agreement(got, ref), 4), **info})
    print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "ok": ok, "results": results}, f, indent=1)
    print("engine parity:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
