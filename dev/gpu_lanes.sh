#!/usr/bin/env bash
# Two lanes of dev/gpu_session.sh at once on a two-GPU machine, one GPU each, so that one device call
# measures twice as much (the parts of a lane run in turn; the lanes share nothing but the host):
#   LANE0="tests refresh" LANE1="train lora_decode" bash .sglang/with-sglang.sh bash dev/gpu_lanes.sh
# Each lane writes $OUT/laneN/results.tgz and $OUT/laneN.log; each has its own model cache.
set -uo pipefail
OUT=${OUT:-gpu_results}
pids=()
for lane in 0 1; do
  var=LANE$lane; parts=${!var:-}
  [ -z "$parts" ] && continue
  mkdir -p "$OUT/lane$lane"
  CUDA_VISIBLE_DEVICES=$lane OUT=$OUT/lane$lane LORABENCH_CACHE=/tmp/lorabench-cache-$lane \
    LORABENCH_GPU_RUNS=/tmp/lorabench-gpu-runs-$lane bash dev/gpu_session.sh $parts > "$OUT/lane$lane.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
cat "$OUT"/lane*.log
exit $status
