#!/usr/bin/env bash
# Wide-EP offline throughput on one machine: DP1 against DP2 + EP2 (each rank gets half the
# cores), every backend, with the per-rank step-time breakdown (attention and dense layers,
# routed experts, MoE communication, idle), on preset:deepseek-v3-small.
# Usage: benchmarks/ep_throughput.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/ep}
MODEL=${MODEL:-preset:deepseek-v3-small}
ARGS="--input-len 128 --output-len 128 --num-prompts 64 --dtype bfloat16 --kv-cache-memory 2GiB --collect-step-breakdown"
mkdir -p "$OUT"
.venv/bin/widellm bench throughput --model "$MODEL" $ARGS --output-json "$OUT/dp1.json"
for backend in all2all allgather_reducescatter all2all_fixed; do
  .venv/bin/widellm bench throughput --model "$MODEL" $ARGS --data-parallel-size 2 \
      --enable-expert-parallel --all2all-backend $backend --output-json "$OUT/dp2-ep2-$backend.json"
done
