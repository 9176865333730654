#!/usr/bin/env bash
# Offline throughput, side by side in one session: widellm, then vLLM (CPU build, own venv),
# on the same checkpoint folders, prompts (shared seed rule), dtype, KV budget and cores.
# Usage: benchmarks/throughput_compare.sh [OUT_DIR]   (vLLM venv at $VLLM_PYTHON)
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
for name in dsv3:$DSV3 smollm2:$SMOL; do
  tag=${name%%:*}; path=${name#*:}
  wait_idle
  .venv/bin/widellm bench throughput --model "$path" $ARGS --kv-cache-memory ${KV_GIB}GiB \
      --output-json "$OUT/widellm-$tag.json"
  wait_idle
  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=$KV_GIB \
      "$VLLM_PYTHON" benchmarks/vllm_throughput.py --model "$path" $ARGS \
      --output-json "$OUT/vllm-$tag.json"
done
