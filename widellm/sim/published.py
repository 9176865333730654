"""Published wide-EP results of DeepSeek-V3 serving and what the cost model predicts for each
setup, from per-rank loads built by hand (uniform routing, balanced ranks, steady state).

The setups (each figure with its source):

* DeepSeek's own profile (github.com/deepseek-ai/profile-data, throughputs as tabulated in the
  LMSYS blog of 2025-05-05, "Profile Results"), H800, balanced routing, two micro-batches:
  decode EP128, 128 requests per GPU at 4,096 KV tokens, 18,598 tok/s per node; prefill EP32,
  16,384 tokens per GPU of 4,096-token prompts, 62,713 tok/s per node. **The one fit**:
  ``hardware.A2A_IN_PIPELINE_FACTOR`` is derived from these two (:func:`fit_a2a_factor`).
* SGLang (LMSYS blog, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert
  Parallelism on 96 H100 GPUs", 2025-05-05), H100: decode EP72, 256 sequences per GPU at 2,000
  input tokens, 22,282 tok/s per node; prefill EP32, 16,384 tokens per GPU, 57,674 / 54,543 /
  50,302 tok/s per node at 1K / 2K / 4K prompts (EPLB from in-distribution statistics) and
  59,337 at 4K with simulated perfect EPLB; TBO in decode +25.5% at 256 tokens per GPU, -27%
  at 32.
* vLLM (blog "vLLM Large Scale Serving: DeepSeek @ 2.2k tok/s/H200 with Wide-EP",
  2025-12-17): ~2,200 output tok/s per H200. Its follow-up ("Driving vLLM WideEP and
  Large-Scale Serving Toward Maturity on Blackwell (Part I)", 2026-02-03) names the figure
  "2.2k tok/s/H200 decode throughput" (tokens per decode GPU per second), for 2K in / 2K out,
  on an H200 deployment of 16 prefill and 32 decode GPUs: decode at EP32, so a mean context of
  ~3,000. The concurrency is not published; 256 requests per rank is the issue's assumption.

Every setup uses FP8 weights, 32 redundant experts, DeepEP's low-latency kernels with CUDA
graphs in decode and its normal kernels in prefill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from widellm.sim import links
from widellm.sim.cost_model import make_cost_model
from widellm.sim.hardware import H100, H200, H800, HardwareProfile
from widellm.sim.known_models import DEEPSEEK_V3
from widellm.sim.types import DeploymentShape, RankStepCost, RankStepLoad

TOP_K = DEEPSEEK_V3["num_experts_per_tok"]
EXPERTS = DEEPSEEK_V3["n_routed_experts"]
REDUNDANT = 32
GPUS_PER_NODE = 8


@dataclass(frozen=True, slots=True)
class Setup:
    """One published configuration and its figure.

    Attributes:
        name: what it is, and its unit.
        profile: the GPU.
        ep: expert-parallel ranks.
        rows: tokens per GPU per step (decode: sequences; prefill: prompt tokens).
        ctx: decode context per sequence (0 for prefill).
        prompt_len: prefill prompt length (0 for decode).
        published: the published throughput (per node, or per GPU when ``per_gpu``).
        per_gpu: the figure is per GPU, not per node.
        dbo: two micro-batches.
    """

    name: str
    profile: HardwareProfile
    ep: int
    rows: int
    published: float
    ctx: int = 0
    prompt_len: int = 0
    per_gpu: bool = False
    dbo: bool = True


DEEPSEEK_DECODE = Setup("DeepSeek profile decode, H800 EP128, 128/GPU, ctx 4096 (tok/s/node)",
                        H800, 128, 128, 18598.0, ctx=4096)
DEEPSEEK_PREFILL = Setup("DeepSeek profile prefill, H800 EP32, 16K/GPU, 4K prompts (tok/s/node)",
                         H800, 32, 16384, 62713.0, prompt_len=4096)
SGLANG_DECODE = Setup("SGLang decode, H100 EP72, 256/GPU, ctx 2000 (tok/s/node)",
                      H100, 72, 256, 22282.0, ctx=2000)
SGLANG_PREFILL = tuple(
    Setup(f"SGLang prefill, H100 EP32, 16K/GPU, {n}-token prompts (tok/s/node)",
          H100, 32, 16384, published, prompt_len=n)
    for n, published in ((1024, 57674.0), (2048, 54543.0), (4096, 50302.0)))
SGLANG_PREFILL_PERFECT_EPLB = Setup(
    "SGLang prefill, perfect EPLB, H100 EP32, 16K/GPU, 4K prompts (tok/s/node)",
    H100, 32, 16384, 59337.0, prompt_len=4096)
VLLM_DECODE = Setup("vLLM decode, H200 EP32, 256/rank, ctx 3000 (tok/s/GPU)",
                    H200, 32, 256, 2200.0, ctx=3000, per_gpu=True)
SGLANG_TBO_GAIN = ((256, 0.255), (32, -0.27))  # tokens per GPU, published TBO gain


def rank_load(setup: Setup) -> RankStepLoad:
    """One rank's load: uniform routing over the ranks, every local expert active."""
    copies = setup.rows * TOP_K
    _, intra, inter = links.uniform_copies_split(copies, setup.ep, GPUS_PER_NODE)
    local = (EXPERTS + REDUNDANT) // setup.ep
    common = dict(expert_recv_tokens=copies, max_expert_tokens=copies / local,
                  active_local_experts=local, sent_intra_node=intra, sent_inter_node=inter)
    if setup.prompt_len:
        n = setup.prompt_len
        prompts = setup.rows // n
        return RankStepLoad(num_tokens=setup.rows, num_prefill_tokens=setup.rows,
                            num_seqs=prompts, attn_score_pairs=prompts * n * (n + 1) // 2,
                            **common)
    return RankStepLoad(num_tokens=setup.rows, num_decode_tokens=setup.rows,
                        num_seqs=setup.rows, attn_kv_read_tokens=setup.rows * setup.ctx,
                        attn_score_pairs=setup.rows * setup.ctx, **common)


def step_cost(setup: Setup, profile: HardwareProfile | None = None,
              dbo: bool | None = None) -> RankStepCost:
    """The cost model's step for ``setup`` (optionally on another profile, or DBO toggled)."""
    decode = not setup.prompt_len
    dep = DeploymentShape(num_ranks=setup.ep, ranks_per_node=GPUS_PER_NODE,
                          all2all_backend="all2all_fixed" if decode else "all2all",
                          cuda_graphs=decode, num_redundant_experts=REDUNDANT)
    model = make_cost_model(DEEPSEEK_V3, profile or setup.profile, dep, weight_dtype="fp8")
    # Balanced ranks: one load priced for all (the lockstep max of equal ranks is the same).
    return model.step([rank_load(setup)] * setup.ep,
                      split=setup.dbo if dbo is None else dbo)[0]


def predict(setup: Setup, profile: HardwareProfile | None = None) -> float:
    """Predicted throughput in the unit of ``setup.published``."""
    per_gpu = setup.rows / step_cost(setup, profile).total_s
    return per_gpu if setup.per_gpu else GPUS_PER_NODE * per_gpu


def tbo_gain(tokens_per_gpu: int) -> float:
    """SGLang's decode TBO ablation (H100 EP72, 2,000-token inputs): plain / TBO - 1."""
    setup = replace(SGLANG_DECODE, rows=tokens_per_gpu)
    return step_cost(setup, dbo=False).total_s / step_cost(setup, dbo=True).total_s - 1.0


def fit_a2a_factor(setup: Setup, lo: float = 0.5, hi: float = 4.0, tol: float = 1e-3) -> float:
    """The all-to-all factor at which the model reproduces ``setup`` exactly (bisection: a
    larger factor means a longer step). Raises when none in [lo, hi] does."""
    def error(factor: float) -> float:
        profile = replace(setup.profile, a2a_in_pipeline_factor=factor)
        return predict(setup, profile) / setup.published - 1.0

    if error(lo) < 0 or error(hi) > 0:
        raise ValueError(f"no all-to-all factor in [{lo}, {hi}] reproduces {setup.name}")
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if error(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def fitted_a2a_factor() -> tuple[float, float, float]:
    """(decode fit, prefill fit, their geometric mean) on DeepSeek's published profile."""
    d, p = fit_a2a_factor(DEEPSEEK_DECODE), fit_a2a_factor(DEEPSEEK_PREFILL)
    return d, p, math.sqrt(d * p)
