#!/usr/bin/env bash
# The request metrics' cost on a server (issue 27): `widellm bench serve` at concurrency 64
# against two `widellm serve` of the default model, one recording every histogram of vLLM's
# V1 metric set ("with") and one leaving out those the set added ("without", see
# benchmarks/metrics_cost_server.py). Only the side being measured has requests (the other's
# engine core sleeps on its socket). The sides alternate ("without" first in odd rounds);
# each runs ROUNDS times. Goal: "with" at most 2% below "without" in output tok/s.
# Usage: [NUM_PROMPTS=256] benchmarks/metrics_cost.sh [OUT_DIR] [ROUNDS]; then:
# .venv/bin/python benchmarks/metrics_cost_table.py OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/metrics-cost}
ROUNDS=${2:-3}
PY=.venv/bin/python
free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
declare -A PORT=([with]=$(free_port) [without]=$(free_port))
NUM_PROMPTS=${NUM_PROMPTS:-256}
# --ignore-eos: every request generates its 128 tokens on both sides (the same work).
BENCH="--endpoint /v1/completions --max-concurrency 64 --num-prompts $NUM_PROMPTS"
BENCH="$BENCH --input-len 128 --output-len 128 --ignore-eos --num-warmups 16 --disable-tqdm --tokenizer SmolLM2-135M-Instruct"
mkdir -p "$OUT"
pids=()
stop_all() { for p in "${pids[@]:-}"; do [ -n "$p" ] && kill -- -"$p" 2>/dev/null || true; done; }
trap stop_all EXIT
for mode in with without; do
  setsid $PY benchmarks/metrics_cost_server.py $mode --port "${PORT[$mode]}" \
      --disable-uvicorn-access-log > "$OUT/server-$mode.log" 2>&1 &
  pids+=($!)
done
for mode in with without; do
  until curl -sf "http://127.0.0.1:${PORT[$mode]}/health" > /dev/null; do
    kill -0 "${pids[0]}" "${pids[1]}" 2>/dev/null || { echo "a server died, see $OUT" >&2; exit 1; }
    sleep 1
  done
  # One untimed run per side first: a fresh server's first run meets batch shapes whose
  # kernels it has not built yet, which would land on whichever side went first.
  .venv/bin/widellm bench serve $BENCH --base-url "http://127.0.0.1:${PORT[$mode]}" \
      > "$OUT/warm-$mode.log" 2>&1 || echo "FAILED, see $OUT/warm-$mode.log" >&2
done
for round in $(seq 1 "$ROUNDS"); do
  order="without with"; [ $((round % 2)) = 0 ] && order="with without"
  for mode in $order; do
    name="$mode-r$round"
    echo "== $name" >&2
    .venv/bin/widellm bench serve $BENCH --base-url "http://127.0.0.1:${PORT[$mode]}" \
        --output-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 \
        || echo "FAILED, see $OUT/$name.log" >&2
    grep -i "output token throughput" "$OUT/$name.log" >&2 || true
  done
done
