"""What the simulator's cost model predicts for the published wide-EP results of
``widellm/sim/published.py`` (setups and sources there), next to the published figures.

    .venv/bin/python benchmarks/sim_published_check.py

The one constant fitted to a published figure is the all-to-all in-pipeline factor, on
DeepSeek's own profile (the first two rows); the script re-derives it. The SGLang and vLLM rows
are predictions.
"""

from __future__ import annotations

from widellm.sim import published as pub
from widellm.sim.hardware import A2A_IN_PIPELINE_FACTOR

BREAKDOWN = ("attention", "dense_gemm", "expert_gemm", "elementwise", "exposed_comm",
             "hidden_comm", "launch")


def _fmt(cost) -> str:
    b = cost.breakdown
    return ", ".join(f"{k} {b[k] * 1e3:.1f}" for k in BREAKDOWN) + " ms"


def main() -> None:
    d, p, mean = pub.fitted_a2a_factor()
    print(f"all-to-all in-pipeline factor: decode fit {d:.3f}, prefill fit {p:.3f}, geometric "
          f"mean {mean:.3f} (hardware.A2A_IN_PIPELINE_FACTOR = {A2A_IN_PIPELINE_FACTOR})\n")
    setups = (pub.DEEPSEEK_DECODE, pub.DEEPSEEK_PREFILL, pub.SGLANG_DECODE,
              *pub.SGLANG_PREFILL, pub.SGLANG_PREFILL_PERFECT_EPLB, pub.VLLM_DECODE)
    print(f"{'setup':76s} {'model':>8s} {'published':>10s} {'ratio':>6s}")
    for setup in setups:
        predicted = pub.predict(setup)
        cost = pub.step_cost(setup)
        print(f"{setup.name:76s} {predicted:8.0f} {setup.published:10.0f} "
              f"{predicted / setup.published:6.3f}")
        print(f"{'':4s}step {cost.total_s * 1e3:.1f} ms: {_fmt(cost)}")
    for tokens, published in pub.SGLANG_TBO_GAIN:
        print(f"SGLang TBO in decode at {tokens} tokens/GPU: model {pub.tbo_gain(tokens):+.1%}, "
              f"published {published:+.1%}")


if __name__ == "__main__":
    main()
