#!/usr/bin/env bash
# DBO's hand-overs with the variable all-to-all, old code vs this checkout, side by side:
# prefill-heavy bench throughput (16 x 2048 in / 16 out) on preset:deepseek-v3-small, DP2 + EP2,
# --all2all-backend all2all, DBO on with BASE_REV's code (a git worktree first on PYTHONPATH,
# run through the console script so that the current folder does not come first) and with this
# checkout's, and DBO off (this checkout) as the exposed-communication baseline; the order of
# the three rotates every round.
# Usage: benchmarks/dbo_handover_compare.sh OUT_DIR BASE_REV [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1; BASE_REV=$2; ROUNDS=${3:-2}
ARGS="--model preset:deepseek-v3-small --dtype float32 --kv-cache-memory 2GiB
      --collect-step-breakdown --num-prompts 16 --input-len 2048 --output-len 16
      --data-parallel-size 2 --enable-expert-parallel --all2all-backend all2all
      --async-scheduling"
BASE_TREE=$(mktemp -d)/base
git worktree add --detach "$BASE_TREE" "$BASE_REV" >/dev/null
trap 'git worktree remove --force "$BASE_TREE"' EXIT
(cd /tmp && PYTHONPATH=$BASE_TREE "$OLDPWD/.venv/bin/python" -c \
    'import widellm; print("base code:", widellm.__file__)') >&2
mkdir -p "$OUT"
run() {  # name, pythonpath, dbo
  echo "== $1" >&2
  PYTHONPATH=$2 .venv/bin/widellm bench throughput $ARGS --enable-dbo "$3" \
      --output-json "$OUT/$1.json" > "$OUT/$1.log" 2>&1 || echo "FAILED, see $OUT/$1.log" >&2
  tail -n 1 "$OUT/$1.log" >&2
}
orders=("base head off" "head off base" "off base head")
for r in $(seq 1 "$ROUNDS"); do
  for side in ${orders[$(((r - 1) % 3))]}; do
    case $side in
      base) run "on-base-r$r" "$BASE_TREE" on ;;
      head) run "on-head-r$r" "$PWD" on ;;
      off) run "off-r$r" "$PWD" off ;;
    esac
  done
done
