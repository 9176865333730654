#!/usr/bin/env bash
# One bench-throughput cell, two versions of widellm side by side in one sitting: BASE (a git
# worktree of an older commit, put first on PYTHONPATH) and this checkout, alternating which
# runs first per round so that the machine's drift does not always favour one side.
# Usage: benchmarks/ab_compare.sh BASE_DIR OUT_DIR ROUNDS NAME -- BENCH_THROUGHPUT_ARGS...
#   e.g. git worktree add -f /work/wt_base 7fdf080
#        benchmarks/ab_compare.sh /work/wt_base bench-results/ab 2 fixed-decode -- \
#          --model preset:deepseek-v3-small --dtype float32 --kv-cache-memory 2GiB \
#          --num-prompts 64 --input-len 128 --output-len 128 --collect-step-breakdown \
#          --data-parallel-size 2 --enable-expert-parallel --all2all-backend all2all_fixed
# then: python benchmarks/ab_table.py OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=$1; OUT=$2; ROUNDS=$3; NAME=$4; shift 4
[ "$1" = "--" ] && shift
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
HERE=$PWD
# An engine started while the previous one's processes wind down loses cores to them.
SETTLE_S=${SETTLE_S:-5}
run() {  # side round BENCH_ARGS...
  local side=$1 round=$2; shift 2
  local json="$OUT/$NAME-$side-r$round.json" log="$OUT/$NAME-$side-r$round.log"
  [ -f "$json" ] && return 0
  sleep "$SETTLE_S"
  echo "== $NAME $side round $round" >&2
  # Each side runs from its own tree: python puts the working folder first on the path.
  local root=$HERE
  [ "$side" = base ] && root=$BASE
  (cd "$root" && PYTHONPATH="$root" "$HERE/.venv/bin/python" -m widellm.entrypoints.cli \
      bench throughput "$@" --output-json "$json") > "$log" 2>&1 || echo "FAILED: $json" >&2
  tail -n 1 "$log" >&2
}
for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) -eq 1 ]; then order="base new"; else order="new base"; fi
  for side in $order; do
    run "$side" "$round" "$@"
  done
done
