"""What the simulator's cost model predicts for four published wide-EP results, from loads
built by hand (uniform routing, balanced ranks, steady state), next to the published figures.

    .venv/bin/python benchmarks/sim_published_check.py

No constant here is fitted to the targets: the model's constants are the datasheet and
published-kernel numbers of ``widellm/sim/hardware.py``. The setups:

1. vLLM wide-EP decode (vLLM blog, "2.2k tok/s per H200"): DeepSeek-V3 on H200, EP32 (4
   nodes), 256 concurrent requests per rank, 2,000 in / 2,000 out (mean context ~3,000),
   DeepEP low-latency, CUDA graphs, DBO, 32 redundant experts. Published: ~2,200 output tok/s
   per GPU.
2. SGLang decode (LMSYS blog 2025-05-05): H100, EP72 (9 nodes), 256 sequences per GPU, 2,000-
   token inputs (context ~2,000), DeepEP low-latency, CUDA graphs, TBO, 32 redundant experts.
   Published: 22,282 tok/s per node.
3. SGLang prefill (same blog): H100, EP32 (4 nodes), 16,384 tokens per GPU per step, DeepEP
   normal mode, TBO. Published: 57,674 / 54,543 / 50,302 tok/s per node at 1K / 2K / 4K.
4. SGLang TBO in decode (same blog): +25.5% at 256 tokens per GPU, a loss at 32.
"""

from __future__ import annotations

from widellm.sim import links
from widellm.sim.cost_model import make_cost_model
from widellm.sim.hardware import H100, H200
from widellm.sim.known_models import DEEPSEEK_V3
from widellm.sim.types import DeploymentShape, RankStepLoad

TOP_K = 8
EXPERTS = 256
REDUNDANT = 32
GPUS_PER_NODE = 8


def _load(rows: int, num_ranks: int, *, prefill_len: int = 0, ctx: int = 0) -> RankStepLoad:
    copies = rows * TOP_K
    _, intra, inter = links.uniform_copies_split(copies, num_ranks, GPUS_PER_NODE)
    local = (EXPERTS + REDUNDANT) // num_ranks
    if prefill_len:
        prompts = rows // prefill_len
        pairs = prompts * prefill_len * (prefill_len + 1) // 2
        return RankStepLoad(num_tokens=rows, num_prefill_tokens=rows, num_seqs=prompts,
                            attn_score_pairs=pairs, expert_recv_tokens=copies,
                            max_expert_tokens=copies / local, active_local_experts=local,
                            sent_intra_node=intra, sent_inter_node=inter)
    return RankStepLoad(num_tokens=rows, num_decode_tokens=rows, num_seqs=rows,
                        attn_kv_read_tokens=rows * ctx, attn_score_pairs=rows * ctx,
                        expert_recv_tokens=copies, max_expert_tokens=copies / local,
                        active_local_experts=local, sent_intra_node=intra,
                        sent_inter_node=inter)


def _step(profile, num_ranks: int, backend: str, load: RankStepLoad, split: bool,
          graphs: bool):
    dep = DeploymentShape(num_ranks=num_ranks, ranks_per_node=GPUS_PER_NODE,
                          all2all_backend=backend, cuda_graphs=graphs,
                          num_redundant_experts=REDUNDANT)
    model = make_cost_model(DEEPSEEK_V3, profile, dep, weight_dtype="fp8")
    # Balanced ranks: one load priced for all (the lockstep max of equal ranks is the same).
    return model.step([load] * num_ranks, split=split)[0]


def _fmt(cost) -> str:
    b = cost.breakdown
    keys = ("attention", "dense_gemm", "expert_gemm", "elementwise", "exposed_comm",
            "hidden_comm", "launch")
    return ", ".join(f"{k} {b[k] * 1e3:.1f}" for k in keys) + " ms"


def main() -> None:
    rows = []
    # 1. vLLM decode, H200 EP32.
    c = _step(H200, 32, "all2all_fixed", _load(256, 32, ctx=3000), split=True, graphs=True)
    rows.append(("vLLM decode H200 EP32, 256/rank, ctx 3000 (tok/s/GPU)",
                 256 / c.total_s, 2200.0, c))
    # 2. SGLang decode, H100 EP72.
    c = _step(H100, 72, "all2all_fixed", _load(256, 72, ctx=2000), split=True, graphs=True)
    rows.append(("SGLang decode H100 EP72, 256/GPU, ctx 2000 (tok/s/node)",
                 GPUS_PER_NODE * 256 / c.total_s, 22282.0, c))
    # 3. SGLang prefill, H100 EP32.
    for length, published in ((1024, 57674.0), (2048, 54543.0), (4096, 50302.0)):
        c = _step(H100, 32, "all2all", _load(16384, 32, prefill_len=length), split=True,
                  graphs=False)
        rows.append((f"SGLang prefill H100 EP32, {length}-token prompts (tok/s/node)",
                     GPUS_PER_NODE * 16384 / c.total_s, published, c))
    print(f"{'setup':62s} {'model':>9s} {'published':>10s} {'ratio':>6s}")
    for name, predicted, published, cost in rows:
        print(f"{name:62s} {predicted:9.0f} {published:10.0f} {predicted / published:6.2f}")
        print(f"{'':4s}step {cost.total_s * 1e3:.1f} ms: {_fmt(cost)}")
    # 4. SGLang TBO effect in decode, H100 EP72.
    for per_gpu, published in ((256, "+25.5%"), (32, "a loss")):
        load = _load(per_gpu, 72, ctx=2000)
        plain = _step(H100, 72, "all2all_fixed", load, split=False, graphs=True)
        split = _step(H100, 72, "all2all_fixed", load, split=True, graphs=True)
        gain = plain.total_s / split.total_s - 1.0
        print(f"TBO at {per_gpu} tokens/GPU: model {gain * 100:+.1f}% (published {published}); "
              f"plain {plain.total_s * 1e3:.1f} ms, TBO {split.total_s * 1e3:.1f} ms")
        print(f"{'':4s}plain: {_fmt(plain)}")
        print(f"{'':4s}TBO:   {_fmt(split)}")


if __name__ == "__main__":
    main()
