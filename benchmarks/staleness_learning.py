"""Does a one-step-stale run learn as the on-policy one does? `lorabench demo` with grpo.max_staleness
= 0 and = 1, the same seeds, the held-out reward before and after (the demo's own evaluation) and the
step time, so the difference between the two can be read against the spread across seeds.

    python benchmarks/staleness_learning.py --out benchmarks/results/staleness_learning_cpu.json
    python benchmarks/staleness_learning.py --out /tmp/s.json engine.backend=sglang engine.sglang.base_gpu_id=1

The overrides go to every run (the demo's defaults otherwise: the tiny model, the hf engine on the
CPU). Each run is its own process, as a user's `lorabench demo` is; the model cache is the user's.
The seeds vary the run (problems, sampling, the adapter's init), not the model: every run gets the
demo's warm-started model of seed 0 by path, since run.seed would also pick another warm start.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def demo_run(run_parent: Path, staleness: int, seed: int, overrides: list[str], limit: float) -> dict:
    name = f"stale{staleness}-seed{seed}"
    cmd = [sys.executable, "-m", "lorabench.cli", "demo", f"run.out_dir={run_parent}", f"run.name={name}",
           f"run.seed={seed}", f"grpo.max_staleness={staleness}", *overrides]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as err:
        tail = [(out or b"")[-2000:].decode(errors="replace") for out in (err.stdout, err.stderr)]
        raise SystemExit(f"{name} ran past --run-limit {limit:g} s; its output's end:\n{tail[0]}\n{tail[1]}") from err
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    run_dir = run_parent / name
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"staleness": staleness, "seed": seed, "heldout_before": summary["heldout_strict_before"],
            "heldout_after": summary["heldout_strict_after"], "greedy_after": summary["heldout_greedy_after"],
            "train_reward_last5": summary["train_reward_last5"], "seconds_grpo": summary["seconds_grpo"],
            "step_s_p50": statistics.median(r["time/step_s"] for r in rows[1:]),
            "lags": [r.get("adapter/lag", 0) for r in rows]}


def spread(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarise(result: dict) -> None:
    """Per staleness: the held-out reward after and its gain, the GRPO wall time (the honest time: a
    stale step's own time/step_s hides the rollout that overlapped it) and the step's p50; then
    whether the two arms' mean held-out reward differ by less than either arm's spread over seeds."""
    for staleness in (0, 1):
        rows = [r for r in result["runs"] if r["staleness"] == staleness]
        result[f"staleness_{staleness}"] = {
            "heldout_gain": spread([r["heldout_after"] - r["heldout_before"] for r in rows]),
            "heldout_after": spread([r["heldout_after"] for r in rows]),
            "seconds_grpo": spread([r["seconds_grpo"] for r in rows]),
            "step_s_p50": spread([r["step_s_p50"] for r in rows])}
    on, off = result["staleness_0"]["heldout_after"], result["staleness_1"]["heldout_after"]
    result["difference_of_means"] = off["mean"] - on["mean"]
    result["within_seed_spread"] = abs(result["difference_of_means"]) <= max(on["max"] - on["min"],
                                                                             off["max"] - off["min"])
    result["wall_ratio_stale_over_on_policy"] = (result["staleness_1"]["seconds_grpo"]["mean"]
                                                 / result["staleness_0"]["seconds_grpo"]["mean"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--run-limit", type=float, default=900, help="seconds one demo run may take")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    import torch
    result = {"commit": os.environ.get("LORABENCH_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "cpus": os.cpu_count(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "overrides": args.overrides, "load_before": os.getloadavg(), "runs": []}   # a shared machine's load
    overrides = args.overrides
    if not any(o.startswith("model.name_or_path=") for o in overrides):
        sys.path.insert(0, str(ROOT))
        from lorabench.session import Config, resolve_model
        overrides = [f"model.name_or_path={resolve_model(Config(), log=print)}", *overrides]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:                # alternate the two so machine load falls on both alike
            for staleness in (0, 1):
                print(f"[{time.perf_counter() - t0:7.1f} s] stale{staleness}-seed{seed}: started", flush=True)
                row = demo_run(Path(tmp), staleness, seed, overrides, args.run_limit)
                result["runs"].append(row)
                shown = json.dumps({k: v for k, v in row.items() if k != "lags"})
                print(f"[{time.perf_counter() - t0:7.1f} s] {shown}", flush=True)
                Path(args.out).write_text(json.dumps(result, indent=1))   # a run cut short keeps the runs before
    result["load_after"] = os.getloadavg()
    summarise(result)
    Path(args.out).write_text(json.dumps(result, indent=1))
    on, off = result["staleness_0"]["heldout_after"], result["staleness_1"]["heldout_after"]
    print(f"held-out after: on-policy {on['mean']:.2f} ({on['min']:.2f}-{on['max']:.2f}), one step stale "
          f"{off['mean']:.2f} ({off['min']:.2f}-{off['max']:.2f}); within the seeds' spread: "
          f"{result['within_seed_spread']}; GRPO wall time stale / on-policy "
          f"{result['wall_ratio_stale_over_on_policy']:.2f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
