#!/usr/bin/env bash
# Issue 22's step-pipeline matrix on one machine, one sitting: bench throughput on
# preset:deepseek-v3-small, DP2 + EP2, each all-to-all backend, DBO off / on / auto (async
# scheduling on), on a decode-heavy (64 x 128 in / 128 out) and a prefill-heavy (16 x 2048 in
# / 16 out) workload; then async scheduling off / on at DP1 and DP2 (decode-heavy, DBO off).
# The order of the DBO settings rotates per backend so no setting always runs first.
# Usage: benchmarks/dbo_matrix.sh [OUT_DIR]; then python benchmarks/dbo_table.py OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/dbo}
MODEL=${MODEL:-preset:deepseek-v3-small}
DTYPE=${DTYPE:-float32}
COMMON="--model $MODEL --dtype $DTYPE --kv-cache-memory 2GiB --collect-step-breakdown"
EP="--data-parallel-size 2 --enable-expert-parallel"
declare -A WORKLOAD=([decode]="--num-prompts 64 --input-len 128 --output-len 128"
                     [prefill]="--num-prompts 16 --input-len 2048 --output-len 16")
mkdir -p "$OUT"
run() {  # name, flags...
  local name=$1; shift
  [ -f "$OUT/$name.json" ] && return  # measured already (a rerun fills in what failed)
  echo "== $name: $*" >&2
  .venv/bin/widellm bench throughput $COMMON "$@" --output-json "$OUT/$name.json" \
      > "$OUT/$name.log" 2>&1 || echo "FAILED, see $OUT/$name.log" >&2
  tail -n 1 "$OUT/$name.log" >&2
}
orders=("off on auto" "on auto off" "auto off on")
i=0
for workload in decode prefill; do
  for backend in all2all allgather_reducescatter all2all_fixed; do
    for dbo in ${orders[$((i % 3))]}; do
      run "$workload-$backend-dbo_$dbo" ${WORKLOAD[$workload]} $EP --all2all-backend $backend \
          --async-scheduling --enable-dbo $dbo
    done
    i=$((i + 1))
  done
done
for async in sync async; do
  flag=--async-scheduling; [ $async = sync ] && flag=--no-async-scheduling
  run "decode-dp1-$async" ${WORKLOAD[decode]} $flag
  run "decode-dp2-all2all-$async" ${WORKLOAD[decode]} $EP --all2all-backend all2all $flag
done
