#!/usr/bin/env bash
# One device call: lorabench's one-pass sampler (engine.sglang.sampling_backend=lorabench) against SGLang's, inside
# the offline stack, from the checkout's root, with lorabench.egg-info carried (SGLang finds the sampler through
# lorabench's entry point; `pip install -e . --no-deps` here writes it):
#   bash .sglang/with-sglang.sh bash dev/fused_sampler/run.sh PART [PART...]     (results into $OUT/fused.tgz)
# PARTS: check (the sampler's draws, log-probs and time against SGLang's sampling ops, no engine),
#        group (benchmarks/group_step.py with the one-pass sampler, then with SGLang's, under a private MPS daemon;
#               $FUSED_GROUP_ARGS, default 16x8x128 K=4 one step stale, triton attention; $FUSED_GROUP_LIMIT s each;
#               $FUSED_VARIANTS, default "lorabench pytorch", to run one of them; $FUSED_OVERRIDES, more --overrides),
#        sampling (benchmarks/sampling_cost_gpu.py with each; $FUSED_SAMPLING_ARGS, default 2,048 rows, four adapters).
# Each part prints its elapsed time, stops at its limit and is packed at once, so a call cut short keeps the rest.
RES=$OUT/fused; mkdir -p "$RES"; start=$(date +%s)
run() {   # run NAME LIMIT COMMAND...: one run, its log, stopped at its limit, packed after
  local name=$1 limit=$2; shift 2
  echo "=== [$(( $(date +%s) - start )) s] $name (limit $limit s)"
  timeout -k 10 "$limit" "$@" > >(tee "$RES/$name.log") 2>&1
  echo "=== [$(( $(date +%s) - start )) s] $name: exit $?"
  tar -czf "$OUT/fused.tgz" -C "$RES" .
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$RES/gpu.txt"
python -c "from lorabench.engines.sglang_internals import sampler_plugin_found as f; print('plugin found:', f())"
group_limit=${FUSED_GROUP_LIMIT:-200}
for part in "$@"; do
  case $part in
    check) run check 60 python dev/fused_sampler/check.py --out "$RES/check.json" ;;
    group) export CUDA_MPS_PIPE_DIRECTORY=/tmp/lorabench-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/lorabench-mps/log
           mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d && echo "MPS started"
           for backend in ${FUSED_VARIANTS:-lorabench pytorch}; do
             run group_$backend "$group_limit" python benchmarks/group_step.py --out "$RES/group_step_$backend.json" \
               --limit $(( group_limit - 15 )) ${FUSED_GROUP_ARGS:---sizes 16x8x128 --ks 4 --steps 5 \
               --group-overrides grpo.max_staleness=1} --overrides grpo.activation_checkpointing=false \
               engine.sglang.attention_backend=triton engine.sglang.sampling_backend=$backend ${FUSED_OVERRIDES:-}
           done
           echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY ;;
    sampling) for backend in lorabench pytorch; do
                run sampling_$backend 90 python benchmarks/sampling_cost_gpu.py --out "$RES/sampling_$backend.json" \
                  --limit 80 --sampling-backend $backend ${FUSED_SAMPLING_ARGS:---batches 2048 --variants logprob_k4}
              done ;;
    *) echo "unknown part $part (check, group, sampling)" ;;
  esac
done
