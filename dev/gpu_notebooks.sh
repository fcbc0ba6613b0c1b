#!/usr/bin/env bash
# Notebook 02 with the SGLang engine, in a real Jupyter kernel on the GPU machine (figures as PNG
# in $OUT/nb02), then the memory release/resume GPU test. From the checkout's root:
#   bash .sglang/with-sglang.sh bash .gpu-extras/with-extras.sh bash dev/gpu_notebooks.sh
# (.gpu-extras: nbclient/ipykernel/torch_memory_saver wheels for the offline GPU machine, built by
# dev/gpu_extras/build.sh; carry .gpu-extras/extras-site-lean.tar.xz and .gpu-extras/with-extras.sh).
set -uo pipefail
OUT=${OUT:-gpu_results}
export LORABENCH_CACHE=${LORABENCH_CACHE:-/tmp/lorabench-cache} PYTHONUNBUFFERED=1
mkdir -p "$OUT/nb02"
python dev/run_notebook_gpu.py notebooks/02_refresh_methods.ipynb "$OUT/nb02" \
  'ENGINE="sglang"' 'MODEL="tiny"' 'RANKS=[8, 32]' 'BUCKETS_MB=[0.1, 1, 16, 512]' 'REPEATS=3' \
  "SAVE_TO=\"$OUT/nb02/refresh_sweep_sglang.json\"" \
  'EXTRA=["engine.attention_backend=triton", "engine.sampling_backend=pytorch", "engine.grammar_backend=none", "engine.extra_args={\"disable_prefill_cuda_graph\": true}", "engine.dtype=bfloat16", "engine.mem_fraction_static=0.3"]' \
  2>&1 | grep -vE "it/s\]|Capturing|Warning|warn" | tail -15
nb=${PIPESTATUS[0]}
bash dev/gpu_suite.sh -k release_resume 2>&1 | grep -E "PASSED|FAILED|SKIPPED|Error|assert|passed|failed|skipped" | tail -20
exit $(( nb || ${PIPESTATUS[0]} ))
