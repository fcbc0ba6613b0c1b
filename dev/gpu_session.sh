#!/usr/bin/env bash
# One device call of our offline GPU machine: what a session measures, into $OUT (the device tool's
# result folder). From the checkout's root, inside the offline sglang stack:
#   CACHE_OUT=$OUT bash .sglang/with-sglang.sh bash dev/gpu_session.sh PART [PART...]
# PARTS: tests (the GPU test files in $LORABENCH_GPU_TESTS, default the single-GPU suite, -k $LORABENCH_GPU_K),
#        suite (call $LORABENCH_SUITE_CALL of dev/gpu_suite_calls.txt, the whole single-GPU suite in seven calls, as
#               tests_each),
#        tests_each (the test ids in $LORABENCH_GPU_IDS, each in a pytest process of its own, stopped after
#                    $LORABENCH_TEST_TIMEOUT s (default 200), or after N s for an id written ID@N: a test that kills
#                    or hangs its process costs only itself),
#        refresh (benchmarks/refresh_gpu.py at tp=$LORABENCH_TP), step (benchmarks/step_gpu.py),
#        user_step (benchmarks/step_user_path.py: RunSession at the defaults, background and in-line commits, then
#                   a second process with torch's compile caches warm),
#        sampling (benchmarks/sampling_cost_gpu.py: decode with and without log-probs, four adapters, the GPU's busy
#                  share, per batch size; $LORABENCH_SAMPLING_ARGS),
#        stale (step_user_path.py, background commit, grpo.max_staleness in $LORABENCH_STALENESS (default "1 0"),
#               $LORABENCH_STALE_ARGS; SGLang's own decode of the batch too with LORABENCH_STALE_DECODE=1),
#        stale_split (MPS: step_user_path.py one step stale at 64x8x256, a process per trainer SM share in
#                     $LORABENCH_SM_SPLITS, default "100 70 50"; the engine keeps every SM),
#        step_variant (step_gpu.py at 64x8x256 only, with $LORABENCH_STEP_VARIANT_ARGS, e.g. an --engine-extra),
#        fits (step_gpu.py --fits-only: the 24 GB check alone; on top of the README's command:
#        LORABENCH_FIT_OVERRIDES="engine.sglang.mem_fraction_static=0.3 grpo.micro_batch_tokens=16384"),
#        train (benchmarks/train_gpu.py, the training settings alone, with a profile; no engine),
#        memory (benchmarks/activation_memory.py on the GPU),
#        lora_decode (benchmarks/lora_decode_gpu.py: SGLang decode with/without LoRA per kernel backend),
#        group_step (benchmarks/group_step.py: K=4 policies on one engine vs one policy, $LORABENCH_GROUP_ARGS),
#        sampler (for each of $LORABENCH_SAMPLERS, default "lorabench pytorch", as engine.sglang.sampling_backend:
#                 SGLang's decode of 2,048 rows, then group_step.py with $LORABENCH_GROUP_ARGS; first
#                 dev/fused_sampler/check.py, the one-pass sampler against SGLang's sampling ops, no engine;
#                 lorabench.egg-info carried, so SGLang finds the plugin;
#                 LORABENCH_SAMPLER_GROUP_ONLY=1: the group steps alone),
#        group_update (benchmarks/group_update.py: K policies' updates one after another vs in one pass, no engine;
#                      $LORABENCH_GROUP_UPDATE_ARGS, default --sizes 16x8x128 64x8x256 --k 4),
#        notebooks (the notebooks with SGLang in a Jupyter kernel; needs .gpu-extras),
#        stale_learning (one GPU: staleness_learning.py's demo runs on SGLang beside the trainer; ~1.5 min a run),
#        own_gpu (two GPUs: step_user_path.py with the engine on cuda:1, grpo.max_staleness 0 and 1),
#        own_gpu_learning (two GPUs: staleness_learning.py's demo runs, engine on cuda:1; ~1.5 min a run);
#        the two-GPU tests are `tests` with LORABENCH_GPU_TESTS=tests/test_sglang_tp2.py.
# LORABENCH_MPS=1 starts a private CUDA MPS daemon first (its pipe dir in the environment of every part), so the
# trainer's and the engine's kernels share the GPU's SMs instead of taking turns; it quits when the call ends.
# Carry .gpu-extras (its lean tarball and with-extras.sh) for `tests` too: its torch_memory_saver
# runs the release/resume test, which skips without it.
# Results (JSON, PNG, one log per part) are packed into $OUT/results.tgz (the device tool brings
# back at most 8 files), re-packed after each part; one failing part does not stop the others.
# Each part's log is written to $OUT/PART.log as it runs, so a call cut off by its limit still
# shows how far the part got; LORABENCH_PART_TIMEOUT (seconds) stops a part in time to pack. pytest
# runs with --capture=tee-sys: its default fd capture held back every line (the tests' progress too)
# of a test until the test ended, so a part stopped mid-test logged nothing of it.
set -uo pipefail
OUT=${OUT:-gpu_results}
RES=$(mktemp -d /tmp/gpu-results-XXXX)
export LORABENCH_GPU_OUT=$RES LORABENCH_CACHE=${LORABENCH_CACHE:-/tmp/lorabench-cache}
# "-dirty": the tree is not that commit (a device copy may carry an older .git than its files: pass LORABENCH_COMMIT)
export LORABENCH_COMMIT=${LORABENCH_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RES/gpu.txt" 2>&1
# whether a CUDA compiler is there (FlashInfer's kernels, which the offline stack leaves out, are compiled at first use)
{ command -v nvcc && nvcc --version | tail -2; } >> "$RES/gpu.txt" 2>&1 || echo "nvcc: not found" >> "$RES/gpu.txt"
# the sampler a run gets at the defaults: auto is lorabench's where SGLang finds its entry point (carry lorabench.egg-info)
python -c "from lorabench.engines.sglang import SGLangSettings as S; print('sampling_backend=auto:', S().sampler() or 'SGLang default')" \
  2>&1 | tee -a "$RES/gpu.txt"
status=0
if [ -n "${LORABENCH_MPS:-}" ]; then   # a private CUDA MPS daemon for this call's processes (trainer + engine share the SMs)
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/lorabench-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/lorabench-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then echo "MPS daemon started ($CUDA_MPS_PIPE_DIRECTORY)" | tee "$RES/mps.txt"
  else echo "MPS daemon did not start: the parts run without it" | tee "$RES/mps.txt"; unset CUDA_MPS_PIPE_DIRECTORY; fi
  trap 'echo quit | nvidia-cuda-mps-control 2>/dev/null' EXIT
fi
extras=.gpu-extras; [ -d $extras ] || extras=../.gpu-extras   # run from a snapshot dir too
with_extras=(); [ -f $extras/with-extras.sh ] && with_extras=(bash $extras/with-extras.sh)
part_timeout=(); [ -n "${LORABENCH_PART_TIMEOUT:-}" ] && part_timeout=(timeout -k 10 "$LORABENCH_PART_TIMEOUT")
for part in "$@"; do
  start=$(date +%s)
  case $part in
    tests) "${part_timeout[@]}" "${with_extras[@]}" python -m pytest -m gpu -v -p no:cacheprovider --capture=tee-sys ${LORABENCH_GPU_K:+-k "$LORABENCH_GPU_K"} \
             ${LORABENCH_GPU_TESTS:-tests/test_sglang_gpu.py tests/test_policy_compile_gpu.py} ;;
    suite|tests_each) [ "$part" = suite ] && LORABENCH_GPU_IDS=$(awk -v n="${LORABENCH_SUITE_CALL:?name the call}" \
                   '$1 == n {print $2}' dev/gpu_suite_calls.txt)
                for entry in ${LORABENCH_GPU_IDS:?name the test ids}; do
                  id=${entry%@*}; limit=${LORABENCH_TEST_TIMEOUT:-200}; [ "$id" = "$entry" ] || limit=${entry##*@}
                  echo "=== $id (limit $limit s)"; t0=$(date +%s)
                  timeout -k 10 "$limit" "${with_extras[@]}" python -m pytest -m gpu -v -rA --tb=short \
                    -o faulthandler_timeout=$(( limit - 20 )) -p no:cacheprovider --capture=tee-sys "$id"
                  echo "=== $id: exit $? in $(( $(date +%s) - t0 )) s"
                  tar -czf "$OUT/results.tgz" -C "$RES" .
                done ;;
    refresh) "${part_timeout[@]}" python benchmarks/refresh_gpu.py --out "$RES/refresh_tp${LORABENCH_TP:-1}.json" --tp "${LORABENCH_TP:-1}" \
               ${LORABENCH_REFRESH_ARGS:-} ;;
    step) "${part_timeout[@]}" python benchmarks/step_gpu.py --out "$RES/step.json" ${LORABENCH_STEP_ARGS:-} ;;
    user_step) "${part_timeout[@]}" python benchmarks/step_user_path.py --out "$RES/step_user_path.json" ${LORABENCH_USER_STEP_ARGS:-} \
               && "${part_timeout[@]}" python benchmarks/step_user_path.py --out "$RES/step_user_path_warm.json" --modes background \
                    --steps 3 ${LORABENCH_USER_STEP_ARGS:-} ;;
    group_update) "${part_timeout[@]}" python benchmarks/group_update.py --out "$RES/group_update.json" \
                    ${LORABENCH_GROUP_UPDATE_ARGS:---sizes 16x8x128 64x8x256 --k 4} ;;
    sampling) "${part_timeout[@]}" python benchmarks/sampling_cost_gpu.py --out "$RES/sampling_cost.json" --profile-dir "$RES/profile" ${LORABENCH_SAMPLING_ARGS:-} ;;
    stale) "${part_timeout[@]}" python benchmarks/step_user_path.py --out "$RES/step_stale.json" --modes background \
             --staleness ${LORABENCH_STALENESS:-1 0} $([ -n "${LORABENCH_STALE_DECODE:-}" ] || echo --no-decode) ${LORABENCH_STALE_ARGS:-} ;;
    stale_split) for pct in ${LORABENCH_SM_SPLITS:-100 70 50}; do
                   echo "=== trainer SM share $pct%"
                   "${part_timeout[@]}" python benchmarks/step_user_path.py --out "$RES/step_stale_sm$pct.json" --modes background \
                     --staleness 1 --no-decode --sizes 64x8x256 --trainer-sm-percent "$pct" ${LORABENCH_STALE_ARGS:-}
                 done ;;
    step_variant) "${part_timeout[@]}" python benchmarks/step_gpu.py --out "$RES/step_variant.json" --skip-24gb --sizes 64x8x256 \
                    ${LORABENCH_STEP_VARIANT_ARGS:-} ;;
    fits) "${part_timeout[@]}" python benchmarks/step_gpu.py --out "$RES/step_fits.json" --fits-only --fit-overrides "${LORABENCH_FIT_OVERRIDES:-}" \
            ${LORABENCH_FIT_WHICH:+--fits-which "$LORABENCH_FIT_WHICH"} ;;
    train) "${part_timeout[@]}" python benchmarks/train_gpu.py --out "$RES/train.json" --profile-out "$RES/train_profile.txt" \
             ${LORABENCH_TRAIN_ARGS:-} ;;
    lora_decode) "${part_timeout[@]}" python benchmarks/lora_decode_gpu.py --out "$RES/lora_decode.json" ${LORABENCH_DECODE_ARGS:-} ;;
    group_step) "${part_timeout[@]}" python benchmarks/group_step.py --out "$RES/group_step.json" ${LORABENCH_GROUP_ARGS:-} ;;
    sampler) [ -n "${LORABENCH_SAMPLER_GROUP_ONLY:-}" ] || \
               "${part_timeout[@]}" python dev/fused_sampler/check.py --out "$RES/sampler_check.json"
             for backend in ${LORABENCH_SAMPLERS:-lorabench pytorch}; do
               echo "=== engine.sglang.sampling_backend=$backend"
               [ -n "${LORABENCH_SAMPLER_GROUP_ONLY:-}" ] || \
                 "${part_timeout[@]}" python benchmarks/sampling_cost_gpu.py --out "$RES/sampling_$backend.json" \
                   --sampling-backend $backend --batches 2048 --variants logprob_k4 --limit 80
               "${part_timeout[@]}" python benchmarks/group_step.py --out "$RES/group_step_$backend.json" \
                 ${LORABENCH_GROUP_ARGS:-} --overrides engine.sglang.sampling_backend=$backend
             done ;;
    memory) "${part_timeout[@]}" python benchmarks/activation_memory.py --device cuda --out "$RES/activation_memory_gpu.json" ;;
    notebooks) "${part_timeout[@]}" bash $extras/with-extras.sh python dev/run_notebooks_gpu.py "$RES" ;;
    own_gpu) "${part_timeout[@]}" python benchmarks/step_user_path.py --out "$RES/step_own_gpu.json" --modes background \
               --staleness 0 1 --overrides engine.sglang.base_gpu_id=1 engine.sglang.mem_fraction_static=0.85 ;;
    stale_learning) "${part_timeout[@]}" python benchmarks/staleness_learning.py --out "$RES/staleness_learning_gpu.json" \
               engine.backend=sglang engine.sglang.attention_backend=triton \
               engine.sglang.grammar_backend=none engine.sglang.dtype=bfloat16 ${LORABENCH_SEEDS:+--seeds $LORABENCH_SEEDS} ;;
    own_gpu_learning) "${part_timeout[@]}" python benchmarks/staleness_learning.py \
               --out "$RES/staleness_learning_own_gpu.json" \
               engine.backend=sglang engine.sglang.attention_backend=triton \
               engine.sglang.grammar_backend=none engine.sglang.dtype=bfloat16 engine.sglang.base_gpu_id=1 \
               engine.sglang.mem_fraction_static=0.85 ${LORABENCH_SEEDS:+--seeds $LORABENCH_SEEDS} ;;
    *) echo "unknown part $part"; false ;;
  esac > "$OUT/$part.log" 2>&1
  rc=$?
  cp "$OUT/$part.log" "$RES/"
  echo "== $part: exit $rc in $(( $(date +%s) - start )) s"
  grep -E "^===|PASSED|FAILED|ERROR|passed|failed|Error|^\{" "$RES/$part.log" | grep -v "Warning" | tail -25
  if [ $rc -ne 0 ]; then status=$rc; tail -60 "$RES/$part.log"; fi
  tar -czf "$OUT/results.tgz" -C "$RES" .   # after every part: a call cut off by its time limit keeps what ran
done
exit $status
