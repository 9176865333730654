#!/usr/bin/env bash
# Async scheduling off / on, side by side: bench throughput on preset:deepseek-v3-small,
# decode-heavy (64 x 128 in / 128 out), at DP1 and at DP2 + EP2 (all2all, DBO off).
# Sync and async alternate (sync first in odd rounds, async first in even ones); each
# configuration runs ROUNDS times. Usage: benchmarks/async_compare.sh [OUT_DIR] [ROUNDS];
# then: python benchmarks/async_table.py OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/async}
ROUNDS=${2:-2}
MODEL=${MODEL:-preset:deepseek-v3-small}
COMMON="--model $MODEL --dtype float32 --kv-cache-memory 2GiB --collect-step-breakdown"
COMMON="$COMMON --num-prompts 64 --input-len 128 --output-len 128"
declare -A SHAPE=([dp1]="" [dp2]="--data-parallel-size 2 --enable-expert-parallel --all2all-backend all2all")
mkdir -p "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  order="sync async"; [ $((round % 2)) = 0 ] && order="async sync"
  for shape in dp1 dp2; do
    for mode in $order; do
      flag=--async-scheduling; [ $mode = sync ] && flag=--no-async-scheduling
      name="$shape-$mode-r$round"
      [ -f "$OUT/$name.json" ] && continue
      echo "== $name" >&2
      .venv/bin/widellm bench throughput $COMMON ${SHAPE[$shape]} $flag \
          --output-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 \
          || echo "FAILED, see $OUT/$name.log" >&2
      tail -n 1 "$OUT/$name.log" >&2
    done
  done
done
