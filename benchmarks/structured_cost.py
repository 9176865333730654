"""Structured outputs' own costs on the default model (SmolLM2-135M-Instruct, 49,152 tokens):

- the grammar backend's start (tokenizer, vocabulary tables), once per engine core;
- compiling benchmarks/structured_schema.json the first time and again (cached);
- per decode step, the token masks (fill the bitmask of every constrained row, apply it,
  advance the matchers: the step breakdown's "grammar" phase) against the step's forward,
  with 16 constrained requests generating 128 tokens each, offline.

Usage: python benchmarks/structured_cost.py [REPEATS]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from widellm import LLM, SamplingParams
from widellm.engine.tokenizer import get_tokenizer
from widellm.model.default_model import DEFAULT_MODEL_NAME
from widellm.sampling_params import StructuredOutputsParams
from widellm.structured_output.xgrammar_backend import XgrammarBackend

SCHEMA = json.loads((Path(__file__).parent / "structured_schema.json").read_text())
VOCAB = 49152
EOS = 2
NUM_REQUESTS = 16
OUTPUT_LEN = 128
MS = 1e3


def compile_times(repeats: int) -> dict:
    tokenizer = get_tokenizer(DEFAULT_MODEL_NAME)
    starts, firsts, cached = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        backend = XgrammarBackend(tokenizer, VOCAB, [EOS])
        t1 = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=SCHEMA))
        t2 = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=SCHEMA))
        t3 = time.perf_counter()
        starts.append(t1 - t0)
        firsts.append(t2 - t1)
        cached.append(t3 - t2)
    return {"backend_start_ms": statistics.median(starts) * MS,
            "first_compile_ms": statistics.median(firsts) * MS,
            "cached_compile_ms": statistics.median(cached) * MS}


def mask_cost() -> dict:
    params = SamplingParams(max_tokens=OUTPUT_LEN, min_tokens=OUTPUT_LEN, ignore_eos=True,
                            temperature=0.0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prompts = [f"Write record set {i} as JSON." for i in range(NUM_REQUESTS)]
    with LLM(collect_step_breakdown=True) as llm:  # the default model
        outs = llm.generate(prompts, params, use_tqdm=False)
        core = llm.llm_engine.engine_core
        totals, steps = dict(core.step_timer.totals), core.num_steps
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"steps": steps, "tokens": tokens,
            "grammar_ms_per_step": totals.get("grammar", 0.0) / steps * MS,
            "forward_ms_per_step": totals.get("forward", 0.0) / steps * MS,
            "sample_ms_per_step": totals.get("sample", 0.0) / steps * MS}


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    result = {**compile_times(repeats), **mask_cost()}
    result["grammar_share_of_forward"] = (result["grammar_ms_per_step"]
                                          / result["forward_ms_per_step"])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
