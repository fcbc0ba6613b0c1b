#!/usr/bin/env bash
# One device call: the fused sampler checked, SGLang's decode of a group's batch with and without it, and the
# group's step with it. Inside the offline stack, from the checkout's root:
#   bash .sglang/with-sglang.sh bash dev/fused_sampler/run.sh     (results into $OUT/fused.tgz)
RES=$OUT/fused; mkdir -p "$RES"; start=$(date +%s)
fused=(env PYTHONPATH="$PWD/dev/fused_sampler:$PYTHONPATH")
part() {   # part NAME LIMIT COMMAND...: one part, its log, stopped at its limit, packed after
  local name=$1 limit=$2; shift 2
  echo "=== [$(( $(date +%s) - start )) s] $name (limit $limit s)"
  timeout -k 10 "$limit" "$@" > >(tee "$RES/$name.log") 2>&1
  echo "=== [$(( $(date +%s) - start )) s] $name: exit $?"
  tar -czf "$OUT/fused.tgz" -C "$RES" .
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$RES/gpu.txt"
part check 60 python dev/fused_sampler/check.py --out "$RES/check.json"
for variant in fused sglang; do
  run=(); [ $variant = fused ] && run=("${fused[@]}")
  part sampling_$variant 130 "${run[@]}" python benchmarks/sampling_cost_gpu.py --out "$RES/sampling_$variant.json" \
    --batches 512,2048 --variants logprob_k4,lorabench_k4 --limit 120
done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/lorabench-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/lorabench-mps/log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d && echo "MPS daemon started"
trap 'echo quit | nvidia-cuda-mps-control 2>/dev/null' EXIT
part group_fused ${LORABENCH_GROUP_LIMIT:-230} "${fused[@]}" python benchmarks/group_step.py \
  --out "$RES/group_step_fused.json" --sizes 16x8x128 --ks 4 --steps 5 --limit $(( ${LORABENCH_GROUP_LIMIT:-230} - 15 )) \
  --overrides grpo.activation_checkpointing=false engine.sglang.attention_backend=triton \
  --group-overrides grpo.max_staleness=1
