"""The demo's end-to-end cost on this machine: wall time and peak memory of `lorabench demo` from a
cold model cache (warm-start included), plus the hf engine's refresh timings from its sync.jsonl.

    python benchmarks/demo_cpu.py [--warm-cache] [key=value ...]
Writes benchmarks/results/cpu_demo.json and prints the figures. Targets: <= 4 min end to end from a
cold cache on 2 cores, <= 4 GB RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--warm-cache", action="store_true", help="reuse ~/.cache/lorabench (skip warm-start)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_demo.json"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.warm_cache:
            env["LORABENCH_CACHE"] = str(Path(tmp) / "cache")
        run_parent = Path(tmp) / "runs"
        cmd = [sys.executable, "-m", "lorabench.cli", "demo", f"run.out_dir={run_parent}", "run.name=bench",
               *args.overrides]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            return proc.returncode
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        run_dir = run_parent / "bench"
        summary = json.loads((run_dir / "summary.json").read_text())
        sync = [json.loads(line) for line in (run_dir / "sync.jsonl").read_text().splitlines()]
    totals = [r for r in sync if r["row"] == "refresh"]
    parts = sorted({k for r in totals for k in r if k.endswith("_s") and k != "total_s"})
    import torch
    result = {
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"), "cold_cache": not args.warm_cache, "overrides": args.overrides,
        "wall_s": wall, "peak_rss_mb": peak_mb, "summary": summary,
        "refresh_ms_p50": {p[:-2]: 1e3 * statistics.median(r[p] for r in totals) for p in parts + ["total_s"]},
        "refresh_mode": totals[0]["mode"] if totals else None,
        "adapter_bytes": totals[0]["bytes"] if totals else None,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"demo wall time {wall:.0f} s (model build + warm-start {summary['seconds_model']:.0f} s, GRPO "
          f"{summary['seconds_grpo']:.0f} s), peak RSS {peak_mb:.0f} MB")
    print(f"held-out strict {summary['heldout_strict_before']:.2f} -> {summary['heldout_strict_after']:.2f}")
    print("hf engine refresh p50 (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in result["refresh_ms_p50"].items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
