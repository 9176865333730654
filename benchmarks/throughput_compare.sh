#!/usr/bin/env bash
# Offline throughput, side by side in one session: widellm, then vLLM (CPU build, own venv),
# on the same checkpoint folders, prompts (shared seed rule), dtype, KV budget and cores.
# Usage: [REPEATS=N] benchmarks/throughput_compare.sh [OUT_DIR]   (vLLM venv at $VLLM_PYTHON)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results}
VLLM_PYTHON=${VLLM_PYTHON:-/work/vllm-venv/bin/python}
KV_GIB=${KV_GIB:-4}
ARGS="--input-len 128 --output-len 128 --num-prompts 64 --dtype bfloat16"
mkdir -p "$OUT"
# An engine started while the previous one's processes still wind down loses cores to them.
SETTLE_S=${SETTLE_S:-15}
wait_idle() { sleep "$SETTLE_S"; }
DSV3=$(.venv/bin/python -m widellm.model.presets preset:deepseek-v3-small | tail -1)
SMOL=$OUT/smollm2-hf
[ -f "$SMOL/config.json" ] || .venv/bin/python -m widellm.model.export default "$SMOL"
run_widellm() {
  .venv/bin/widellm bench throughput --model "$1" $ARGS --kv-cache-memory ${KV_GIB}GiB \
      --output-json "$2"
}
run_vllm() {
  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=$KV_GIB \
      "$VLLM_PYTHON" benchmarks/vllm_throughput.py --model "$1" $ARGS --output-json "$2"
}
# REPEATS > 1: that many pairs per model, the order flipped every other pair, so that the
# machine's drift (+-20-30% over minutes here) does not always favour the engine run first.
REPEATS=${REPEATS:-1}
for r in $(seq 1 "$REPEATS"); do
  suffix=$([ "$REPEATS" -gt 1 ] && echo "-$r" || true)
  for name in dsv3:$DSV3 smollm2:$SMOL; do
    tag=${name%%:*}; path=${name#*:}
    if [ $((r % 2)) -eq 1 ]; then order="widellm vllm"; else order="vllm widellm"; fi
    for engine in $order; do
      wait_idle
      "run_$engine" "$path" "$OUT/$engine-$tag$suffix.json"
    done
  done
done
