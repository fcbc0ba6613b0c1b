#!/usr/bin/env bash
# The whole GPU suite in one device call, from the checkout's root on the GPU machine:
#   bash .sglang/with-sglang.sh bash dev/gpu_suite.sh [pytest args]
# LORABENCH_GPU_TESTS picks the test files (default: the single-GPU suite); the two-GPU suite
# (nvidia-h200-x2) is LORABENCH_GPU_TESTS=tests/test_sglang_tp2.py.
# Figures land in $OUT (the device tool's result folder) or ./gpu_results.
set -uo pipefail
export LORABENCH_GPU_OUT=${OUT:-gpu_results}
export LORABENCH_CACHE=${LORABENCH_CACHE:-/tmp/lorabench-cache}
# "-dirty": the tree is not that commit (a device copy may carry an older .git than its files: pass LORABENCH_COMMIT)
export LORABENCH_COMMIT=${LORABENCH_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$LORABENCH_GPU_OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$LORABENCH_GPU_OUT/gpu.txt" 2>&1
python -m pytest -m gpu -v -p no:cacheprovider -s "$@" ${LORABENCH_GPU_TESTS:-tests/test_sglang_gpu.py tests/test_policy_compile_gpu.py} 2>&1 | tee "$LORABENCH_GPU_OUT/pytest.log"
exit ${PIPESTATUS[0]}
