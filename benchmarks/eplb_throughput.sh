#!/usr/bin/env bash
# EPLB on a skewed DeepSeek-V3-shaped model, DP2 + EP2 on one machine: no EPLB, EPLB with
# R = 0 (re-placement only) and R = 25% of the experts (replicas), plus EPLB recording
# without rebalancing (interval past the run) to isolate the cost of recording and replica
# routing. Per-rank step-time breakdown and EPLB stats in each JSON.
# Usage: benchmarks/eplb_throughput.sh [OUT_DIR] [DP]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/eplb}
DP=${2:-2}
MODEL=${MODEL:-preset:deepseek-v3-small-skewed}
EXPERTS=64
ARGS="--model $MODEL --input-len 128 --output-len 128 --num-prompts 64 --dtype bfloat16 \
  --kv-cache-memory 2GiB --collect-step-breakdown --data-parallel-size $DP --enable-expert-parallel"
EPLB="--enable-eplb --eplb-window-size 16 --eplb-step-interval 16 --eplb-log-balancedness"
mkdir -p "$OUT"
run() { .venv/bin/widellm bench throughput $ARGS "$@"; }
run --output-json "$OUT/dp$DP-off.json"
run $EPLB --eplb-step-interval 100000 --output-json "$OUT/dp$DP-record-only.json"
run $EPLB --output-json "$OUT/dp$DP-r0.json"
run $EPLB --eplb-num-redundant-experts $((EXPERTS / 4)) --output-json "$OUT/dp$DP-r16.json"
