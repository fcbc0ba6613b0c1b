"""What a torch.profiler chrome trace of SGLang's scheduler shows about its decode steps (e.g. the trace that
`benchmarks/sampling_cost_gpu.py --profile-dir` brings back):

    python dev/trace_summary.py TRACE.json.gz

Prints the GPU's busy share of the kernels' span (the union of kernel intervals: under ~90% the step waits on
the CPU), the gaps between CUDA-graph launches (one per decode step), the CPU ops and scheduler phases that took
longest, and the kernels' time per step by family (attention, SGLang's LoRA kernels, GEMMs, the sampler's
softmax, the rest).
"""
from __future__ import annotations

import collections
import gzip
import json
import sys

FAMILIES = (("attention", ("Attention", "attention", "Decode")), ("lora", ("lora",)), ("gemm", ("nvjet", "gemm")),
            ("softmax", ("SoftMax",)))


def family(kernel: str) -> str:
    return next((name for name, keys in FAMILIES if any(key in kernel for key in keys)), "other")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of sorted (start, end) intervals."""
    total, current = 0.0, None
    for start, end in intervals:
        if current is None or start > current[1]:
            total += current[1] - current[0] if current else 0.0
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    return total + (current[1] - current[0] if current else 0.0)


def main(path: str) -> None:
    with gzip.open(path) if path.endswith(".gz") else open(path) as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                       "gpu_memset"))
    span = spans[-1][1] - spans[0][0]
    busy = busy_us(spans)
    print(f"kernels span {span / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({100 * busy / span:.0f}%)")
    launches = sorted(e["ts"] for e in events if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e["name"])
    steps = max(1, len(launches))
    apart = [round((b - a) / 1e3, 1) for a, b in zip(launches, launches[1:])]
    print(f"graph launches {len(launches)}, ms apart: {apart}")
    cpu, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") in ("cpu_op", "python_function", "user_annotation"):
            cpu[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    print("CPU ops and scheduler phases (ms in all, calls):")
    for name, us in cpu.most_common(12):
        print(f"  {us / 1e3:8.1f} {calls[name]:6d}  {name[:90]}")
    by_family = collections.Counter()
    for e in kernels:
        by_family[family(e["name"])] += e["dur"]
    total = sum(by_family.values())
    print(f"kernels per graph launch ({steps}): {total / steps / 1e3:.2f} ms")
    for name, us in by_family.most_common():
        print(f"  {name:10s} {us / steps / 1e3:6.2f} ms  {100 * us / total:5.1f}%")


if __name__ == "__main__":
    main(sys.argv[1])
