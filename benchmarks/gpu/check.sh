#!/usr/bin/env bash
# Issue 25's GPU checks on one H100/H200, within about 8 minutes:
#   1. every Triton kernel test natively (tests/ops/triton: the same tests CI runs in
#      Triton's interpreter, here against the compiled kernels);
#   2. kernel rates (benchmarks/gpu/kernel_rates.py): HBM copy bandwidth, bf16 matmul, the
#      MoE grouped GEMM in bf16 and FP8 W8A8 (goal: FP8 >= 50% of 2 x the bf16 matmul rate),
#      paged and MLA decode attention as shares of the copy bandwidth;
#   3. CUDA engine == CPU engine (benchmarks/gpu/engine_parity.py): greedy fp32 on tiny Llama,
#      DeepSeek-V3 and Qwen3-MoE with decode CUDA graphs and with --enforce-eager, and the FP8
#      preset kept as FP8 against its dequantized twin;
#   4. CUDA graphs vs eager decode at batch 1-64 (benchmarks/gpu/graph_speedup.py; goal 1.5x);
#   5. decode of a DeepSeek-V3-shaped slice of one EP32 rank at 64 and 256 sequences
#      (benchmarks/gpu/ep32_slice.py; goal: 60% of the HBM roofline at 256).
# The CUDA engine is not admitted by --device auto yet; steps 3-5 set WIDELLM_UNVERIFIED_CUDA=1.
# Each step has its own time limit, so one that hangs does not take the others' time.
# The GPU machines' python3 has torch, triton and transformers but not all of widellm's
# dependencies, and nothing can be downloaded there: run `python benchmarks/gpu/wheels.py`
# here first and carry `.whl` with the call; this script installs them into a temporary folder.
# widellm itself is imported from this checkout (PYTHONPATH), not installed.
# Usage: benchmarks/gpu/check.sh [OUT_DIR]   (PYTHON=... to pick the interpreter)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-gpu-results}
PYTHON=${PYTHON:-python3}
SITE=${TMPDIR:-/tmp}/widellm-gpu-site
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || { echo "installing .whl failed" >&2; exit 1; }
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# The CPU engine these checks compare against runs its plain torch path (the reference the
# CPU parity tests check), not the C++ kernels, which would be compiled first (minutes).
export WIDELLM_CPU_KERNELS=0
"$PYTHON" -c 'import torch, triton; assert torch.cuda.is_available(); print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' \
    || { echo "needs torch with CUDA and triton" >&2; exit 1; }
"$PYTHON" -c 'import widellm, widellm.engine.llm_engine' \
    || { echo "widellm does not import: run python benchmarks/gpu/wheels.py here, carry .whl" >&2; exit 1; }
export WIDELLM_UNVERIFIED_CUDA=1
status=0
step() {  # step NAME LIMIT_S COMMAND...: run it, log it, remember a failure
    local name=$1 limit=$2; shift 2
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v '^INFO' | tail -n 20
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "!! $name failed (exit $rc)"; status=1; }
}
step kernel_tests 150 env -u TRITON_INTERPRET "$PYTHON" -m pytest -q tests/ops/triton
step kernel_rates 60 "$PYTHON" benchmarks/gpu/kernel_rates.py --json "$OUT/kernel_rates.json"
step engine_parity 90 "$PYTHON" benchmarks/gpu/engine_parity.py --json "$OUT/engine_parity.json"
step graph_speedup 90 "$PYTHON" benchmarks/gpu/graph_speedup.py --json "$OUT/graph_speedup.json"
step ep32_slice 120 "$PYTHON" benchmarks/gpu/ep32_slice.py --json "$OUT/ep32_slice.json"
exit $status
