#!/usr/bin/env bash
# Structured outputs' cost on a server: `widellm bench serve` at concurrency 16 against one
# `widellm serve` of the default model, every request under benchmarks/structured_schema.json
# (a list of at least 100 records, so every request generates its full --output-len and the
# two sides do the same work) vs no constraint. The sides alternate (unconstrained first in
# odd rounds); each runs ROUNDS times. Usage: benchmarks/structured_compare.sh [OUT_DIR]
# [ROUNDS]; then: python benchmarks/structured_table.py OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/structured}
ROUNDS=${2:-3}
PORT=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
BENCH="--base-url http://127.0.0.1:$PORT --backend openai-chat --max-concurrency 16"
BENCH="$BENCH --num-prompts 64 --input-len 128 --output-len 128 --num-warmups 16 --disable-tqdm"
# Greedy, and every request exactly --output-len tokens (ignore_eos + min_tokens).
BENCH="$BENCH --tokenizer SmolLM2-135M-Instruct --temperature 0 --fixed-output-len"
mkdir -p "$OUT"
.venv/bin/widellm serve --port "$PORT" --disable-uvicorn-access-log > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
  kill -0 $SERVER 2>/dev/null || { echo "server died, see $OUT/server.log" >&2; exit 1; }
  sleep 1
done
# One untimed run first: a fresh server's first run was ~25% slower (kernels of the batch
# shapes it had not met yet), which would land on whichever side went first.
.venv/bin/widellm bench serve $BENCH > "$OUT/warm.log" 2>&1 || echo "FAILED, see $OUT/warm.log" >&2
for round in $(seq 1 "$ROUNDS"); do
  order="none schema"; [ $((round % 2)) = 0 ] && order="schema none"
  for mode in $order; do
    flag=""; [ $mode = schema ] && flag="--json-schema benchmarks/structured_schema.json"
    name="$mode-r$round"
    echo "== $name" >&2
    .venv/bin/widellm bench serve $BENCH $flag --save-result --result-filename "$OUT/$name.json" \
        > "$OUT/$name.log" 2>&1 || echo "FAILED, see $OUT/$name.log" >&2
    grep -i "output token throughput" "$OUT/$name.log" >&2 || true
  done
done
