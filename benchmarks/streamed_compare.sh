#!/usr/bin/env bash
# Issue 23's streamed transfer against the sequential one, one sitting on a 2-core machine: a
# prefill instance (core 0) and a decode instance (core 1) joined by the TCP KV connector,
# with one `widellm proxy` of each --kv-transfer-mode in front; benchmarks/streamed_ttft.py
# alternates the two. Usage: benchmarks/streamed_compare.sh OUT_DIR [MODEL ...] (default:
# SmolLM2 and preset:deepseek-v3-small). Ports from BASE_PORT (default 8400) up.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/streamed}; shift || true
MODELS=("$@"); [ ${#MODELS[@]} -eq 0 ] && MODELS=("" "preset:deepseek-v3-small")
BASE_PORT=${BASE_PORT:-8400}
REPEATS=${REPEATS:-3}
PY=.venv/bin/python
mkdir -p "$OUT"
pids=()
stop_all() { for p in "${pids[@]:-}"; do [ -n "$p" ] && kill -- -"$p" 2>/dev/null || true; done
             pids=(); sleep 2; }
trap stop_all EXIT
start() {  # log, cpus, args...
  local log=$1 cpus=$2; shift 2
  OMP_NUM_THREADS=1 setsid taskset -c "$cpus" $PY -m widellm.entrypoints.cli "$@" > "$log" 2>&1 &
  pids+=($!)
}
wait_up() { for _ in $(seq 600); do curl -sf "$1/health" > /dev/null && return; sleep 1; done
            echo "not up: $1" >&2; exit 1; }
P=$BASE_PORT; D=$((BASE_PORT + 1)); S=$((BASE_PORT + 2)); T=$((BASE_PORT + 3))
producer='{"kv_connector": "TCPConnector", "kv_role": "kv_producer"}'
consumer='{"kv_connector": "TCPConnector", "kv_role": "kv_consumer"}'
for model in "${MODELS[@]}"; do
  name=${model:-smollm2}; name=${name#preset:}
  # Vocabulary size, and the context to run at: room for a 4,096-token prompt where the
  # model allows, else its own limit (the longest prompt then one token shorter).
  read -r V MAXLEN < <($PY -c "import sys; from widellm.engine.arg_utils import EngineArgs as E; \
c = E(model=sys.argv[1] or None).create_engine_config().model_config.hf_config; \
print(c.vocab_size, min(4352, c.max_position_embeddings))" "$model")
  TOP=4096; [ "$MAXLEN" -le $TOP ] && TOP=$((MAXLEN - 1))
  COMMON="--dtype float32 --kv-cache-memory 2GiB --max-model-len $MAXLEN --disable-uvicorn-access-log"
  start "$OUT/$name-prefill.log" 0 serve $model --port $P $COMMON --kv-transfer-config "$producer"
  start "$OUT/$name-decode.log" 1 serve $model --port $D $COMMON --kv-transfer-config "$consumer"
  wait_up http://127.0.0.1:$P; wait_up http://127.0.0.1:$D
  start "$OUT/$name-proxy-seq.log" 0,1 proxy --port $S --prefill http://127.0.0.1:$P \
      --decode http://127.0.0.1:$D
  start "$OUT/$name-proxy-streamed.log" 0,1 proxy --port $T --prefill http://127.0.0.1:$P \
      --decode http://127.0.0.1:$D --kv-transfer-mode streamed
  wait_up http://127.0.0.1:$S; wait_up http://127.0.0.1:$T
  echo "== $name" >&2
  $PY -m benchmarks.streamed_ttft --sequential http://127.0.0.1:$S \
      --streamed http://127.0.0.1:$T --decode http://127.0.0.1:$D --vocab-size "$V" \
      --lengths 512 2048 $TOP --repeats "$REPEATS" --output-json "$OUT/$name.json" >&2
  stop_all
done
