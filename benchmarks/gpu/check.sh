#!/usr/bin/env bash
# Issue 25's GPU checks on one H100/H200, in a few minutes. What this runs today:
#   1. every Triton kernel test natively (tests/ops/triton: the same tests CI runs in
#      Triton's interpreter, here against the compiled kernels);
#   2. kernel rates (benchmarks/gpu/kernel_rates.py): HBM copy bandwidth, bf16 matmul, the
#      MoE grouped GEMM in bf16 and FP8 W8A8 (goal: FP8 >= 50% of 2 x the bf16 matmul rate),
#      paged and MLA decode attention as shares of the copy bandwidth.
# Not yet runnable (no CUDA model runner exists): CUDA engine == CPU engine, CUDA graphs vs
# eager, the EP32-slice decode benchmark. The script says so at the end.
# Usage: benchmarks/gpu/check.sh [OUT_DIR]   (PYTHON=... to pick the interpreter)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-gpu-results}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
"$PYTHON" -c 'import torch, triton; assert torch.cuda.is_available(); print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' \
    || { echo "needs torch with CUDA and triton" >&2; exit 1; }
status=0
echo "== 1. Triton kernels vs their torch twins (native)"
env -u TRITON_INTERPRET "$PYTHON" -m pytest -q tests/ops/triton 2>&1 | tee "$OUT/kernel_tests.log" | tail -n 15
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "== 2. kernel rates"
"$PYTHON" benchmarks/gpu/kernel_rates.py --json "$OUT/kernel_rates.json" || status=1
echo "== not run: CUDA engine == CPU engine, CUDA graphs vs eager, EP32-slice decode (no CUDA model runner yet)"
exit $status
