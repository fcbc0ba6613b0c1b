#!/usr/bin/env bash
# One device call: the fused sampler checked, then a group's step (K=4, 16x8x128, one step stale, MPS) with and
# without it, then SGLang's decode of 2,048 rows with and without it. Inside the offline stack, from the root:
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
export CUDA_MPS_PIPE_DIRECTORY=/tmp/lorabench-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/lorabench-mps/log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d && echo "MPS daemon started"
for variant in fused sglang; do
  run=(); [ $variant = fused ] && run=("${fused[@]}")
  part group_$variant 200 "${run[@]}" python benchmarks/group_step.py --out "$RES/group_step_$variant.json" \
    --sizes 16x8x128 --ks 4 --steps 5 --limit 185 --overrides grpo.activation_checkpointing=false \
    engine.sglang.attention_backend=triton --group-overrides grpo.max_staleness=1
done
echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
for variant in fused sglang; do
  run=(); [ $variant = fused ] && run=("${fused[@]}")
  part sampling_$variant 85 "${run[@]}" python benchmarks/sampling_cost_gpu.py --out "$RES/sampling_$variant.json" \
    --batches 2048 --variants logprob_k4 --limit 80
done
