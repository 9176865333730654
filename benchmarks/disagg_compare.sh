#!/usr/bin/env bash
# Issue 23's benchmark, one sitting on a 2-core machine: one colocated server on both cores
# against a prefill instance (core 0) + a decode instance (core 1) joined by the TCP KV
# connector behind `widellm proxy`, under benchmarks/disagg_mix.py's mix (long prompts
# arriving while many requests decode), alternating the two setups REPEATS times; then the
# transfer itself (benchmarks/kv_transfer_bench.py) on the disaggregated pair.
# Usage: benchmarks/disagg_compare.sh OUT_DIR [MODEL ...]  (default: SmolLM2 and
# preset:deepseek-v3-small). Ports from BASE_PORT (default 8300) up.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/disagg}; shift || true
MODELS=("$@"); [ ${#MODELS[@]} -eq 0 ] && MODELS=("" "preset:deepseek-v3-small")
REPEATS=${REPEATS:-3}
BASE_PORT=${BASE_PORT:-8300}
DTYPE=${DTYPE:-auto}
PY=.venv/bin/python
# Room for a 4,096-token prompt and its output where the model allows (else its limit).
WANT_LEN=4352
mkdir -p "$OUT"
pids=()
stop_all() { for p in "${pids[@]:-}"; do [ -n "$p" ] && kill -- -"$p" 2>/dev/null || true; done
             pids=(); sleep 2; }
trap stop_all EXIT
start() {  # log, cpus, threads, args...
  local log=$1 cpus=$2 threads=$3; shift 3
  OMP_NUM_THREADS=$threads setsid taskset -c "$cpus" $PY -m widellm.entrypoints.cli "$@" \
      > "$log" 2>&1 &
  pids+=($!)
}
wait_up() { for _ in $(seq 600); do curl -sf "$1/health" > /dev/null && return; sleep 1; done
            echo "not up: $1" >&2; exit 1; }
model_info() {  # vocab size, context length to run at
  $PY -c "import sys; from widellm.engine.arg_utils import EngineArgs as E; \
c = E(model=sys.argv[1] or None).create_engine_config().model_config.hf_config; \
print(c.vocab_size, min($WANT_LEN, c.max_position_embeddings))" "$1"; }
P=$BASE_PORT; D=$((BASE_PORT + 1)); X=$((BASE_PORT + 2)); C=$((BASE_PORT + 3))
producer='{"kv_connector": "TCPConnector", "kv_role": "kv_producer"}'
consumer='{"kv_connector": "TCPConnector", "kv_role": "kv_consumer"}'
for model in "${MODELS[@]}"; do
  name=${model:-smollm2}; name=${name#preset:}
  read -r V MAXLEN < <(model_info "$model")
  COMMON="--dtype $DTYPE --kv-cache-memory 2GiB --max-model-len $MAXLEN --disable-uvicorn-access-log"
  TOP=4096; [ "$MAXLEN" -le $TOP ] && TOP=$((MAXLEN - 1))
  for r in $(seq "$REPEATS"); do
    order=("colocated" "disagg"); [ $((r % 2)) -eq 0 ] && order=("disagg" "colocated")
    for setup in "${order[@]}"; do
      if [ "$setup" = colocated ]; then
        start "$OUT/$name-colocated-$r.server.log" 0,1 2 serve $model --port $C $COMMON
        wait_up http://127.0.0.1:$C; url=http://127.0.0.1:$C
      else
        start "$OUT/$name-prefill-$r.log" 0 1 serve $model --port $P $COMMON \
            --kv-transfer-config "$producer"
        start "$OUT/$name-decode-$r.log" 1 1 serve $model --port $D $COMMON \
            --kv-transfer-config "$consumer"
        wait_up http://127.0.0.1:$P; wait_up http://127.0.0.1:$D
        start "$OUT/$name-proxy-$r.log" 0,1 1 proxy --port $X \
            --prefill http://127.0.0.1:$P --decode http://127.0.0.1:$D
        wait_up http://127.0.0.1:$X; url=http://127.0.0.1:$X
      fi
      echo "== $name $setup run $r" >&2
      $PY benchmarks/disagg_mix.py --base-url $url --vocab-size "$V" \
          --output-json "$OUT/$name-$setup-$r.json" | tail -n 12 >&2
      if [ "$setup" = disagg ] && [ "$r" -eq 1 ]; then
        $PY benchmarks/kv_transfer_bench.py --prefill http://127.0.0.1:$P \
            --decode http://127.0.0.1:$D --vocab-size "$V" --lengths 256 512 1024 2048 $TOP \
            --output-json "$OUT/$name-transfer.json" >&2
      fi
      stop_all
    done
  done
done
