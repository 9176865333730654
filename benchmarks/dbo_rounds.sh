#!/usr/bin/env bash
# Repeated rounds of one cell of issue 22's matrix (benchmarks/dbo_matrix.sh runs each cell
# once, and one run is within this machine's noise of the goals): bench throughput on
# preset:deepseek-v3-small, DP2 + EP2, async scheduling on, DBO settings MODES, each ROUNDS
# times; the order of the settings rotates per round, so no setting always runs first.
# Usage: benchmarks/dbo_rounds.sh OUT_DIR ROUNDS WORKLOAD(decode|prefill) BACKEND "MODES"
#   e.g. benchmarks/dbo_rounds.sh bench-results/dbo-rounds 3 decode all2all "off auto"
# then: python benchmarks/dbo_rounds_table.py OUT_DIR
#       python benchmarks/comm_split_table.py OUT_DIR  (exposed time: peers vs transfer)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1; ROUNDS=$2; WORKLOAD_NAME=$3; BACKEND=$4; read -r -a MODES <<< "$5"
MODEL=${MODEL:-preset:deepseek-v3-small}
COMMON="--model $MODEL --dtype float32 --kv-cache-memory 2GiB --collect-step-breakdown"
# ASYNC=0: synchronous scheduling (async scheduling is on otherwise). EXTRA: more bench flags
# (no spaces inside one, e.g. --eplb-config '{"load_path":"load.json","static":true}'), and
# TAG a suffix of the runs' names that tells them apart.
SCHED=$([ "${ASYNC:-1}" = 1 ] && echo --async-scheduling || echo --no-async-scheduling)
EP="--data-parallel-size 2 --enable-expert-parallel --all2all-backend $BACKEND $SCHED"
declare -A WORKLOAD=([decode]="--num-prompts 64 --input-len 128 --output-len 128"
                     [prefill]="--num-prompts 16 --input-len 2048 --output-len 16")
mkdir -p "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  n=${#MODES[@]}
  for k in $(seq 0 $((n - 1))); do
    mode=${MODES[$(((k + round - 1) % n))]}
    name="$WORKLOAD_NAME-$BACKEND${TAG:-}-dbo_$mode-r$round"
    [ -f "$OUT/$name.json" ] && continue
    echo "== $name" >&2
    # Each rank's MoE transfers, for benchmarks/comm_split_table.py.
    mkdir -p "$OUT/$name.trace"
    WIDELLM_COMM_TRACE_DIR="$OUT/$name.trace" \
    .venv/bin/widellm bench throughput $COMMON ${WORKLOAD[$WORKLOAD_NAME]} $EP \
        --enable-dbo "$mode" ${EXTRA:-} --output-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 \
        || echo "FAILED, see $OUT/$name.log" >&2
    tail -n 1 "$OUT/$name.log" >&2
  done
done
