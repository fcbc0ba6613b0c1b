"""Which torch CPU thread count the CPU lessons and the demo should use: seconds per warm-start step
(the tiny model's SFT, notebook 01's first-time wait) and per GRPO step (the demo's defaults, hf
engine) at each thread setting, on a quiet machine and with other CPU-bound processes running.

    python benchmarks/cpu_threads.py [--repeats 3] [--load 0 2] [--settings 1 2 default 2-passive]

Each measurement runs in a fresh process (the thread count and OpenMP's wait policy are fixed when
torch starts its thread pool). Settings: `N` = torch.set_num_threads(N); `default` = torch's own
choice; `2-passive` = 2 threads with OMP_WAIT_POLICY=PASSIVE (waiting threads sleep instead of
spinning). `--load K` starts K busy-loop processes for the measurement and ends them after; every
row records os.getloadavg() before and after it. Runs are interleaved (setting by setting, repeat
by repeat), so a drift in the machine's load spreads over all settings instead of biasing one.
Writes benchmarks/results/cpu_threads.json (every repeat as its own row, and per setting and load the
median and the min-max spread) and cpu_threads.png (each repeat a point).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY_LOOP = "while True: pass"


def child(setting: str, warm_steps: int, grpo_steps: int) -> dict:
    """One measurement in this process: warm-start steps, then GRPO steps; seconds per step."""
    import torch
    if setting != "default":
        torch.set_num_threads(int(setting.split("-")[0]))
    from lorabench.runlog import NullRunLog
    from lorabench.session import Config, build_trainer, resolve_model, start_engine
    from lorabench.tiny import WarmStartSettings, build_tiny_model, build_tiny_tokenizer, warm_start

    tokenizer = build_tiny_tokenizer(None, 0)
    model = build_tiny_model(tokenizer, 0)
    warm_start(model, tokenizer, WarmStartSettings(steps=2), 0, log=lambda *_: None)   # allocator warm-up
    t0 = time.perf_counter()
    warm_start(model, tokenizer, WarmStartSettings(steps=warm_steps), 0, log=lambda *_: None)
    warm_s = (time.perf_counter() - t0) / warm_steps

    cfg = Config.load(None, ["engine.backend=hf", "model.name_or_path=tiny"])
    model_path = resolve_model(cfg, log=lambda *_: None)
    engine = start_engine(cfg, model_path)
    trainer = build_trainer(cfg, model_path, engine, NullRunLog(cfg.run), log=lambda *_: None)
    trainer.step()   # the first step pays one-off costs
    steps = []
    for _ in range(grpo_steps):
        t0 = time.perf_counter()
        trainer.step()
        steps.append(time.perf_counter() - t0)
    trainer.close()
    engine.close()
    return {"threads": torch.get_num_threads(), "warmstart_s_per_step": warm_s,
            "grpo_s_per_step": statistics.median(steps), "grpo_steps_s": steps}


def measure(setting: str, warm_steps: int, grpo_steps: int) -> dict:
    """`child` in a fresh interpreter, with OMP_WAIT_POLICY=PASSIVE for a `-passive` setting."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if setting.endswith("-passive"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", setting, "--warm-steps", str(warm_steps),
                          "--grpo-steps", str(grpo_steps)], env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"setting {setting}: {out.stderr[-2000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"setting": setting, **row, "wall_s": time.perf_counter() - t0,
            "loadavg_1min_before": load_before, "loadavg_1min_after": os.getloadavg()[0]}


def under_load(processes: int):
    """Start `processes` busy loops (the other CPU-bound work of a shared machine); returns them."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(processes)]


def summary(rows: list[dict]) -> list[dict]:
    """Per (load, setting): median and min-max of each per-step time over the repeats."""
    out = []
    for load in sorted({r["extra_load"] for r in rows}):
        for setting in dict.fromkeys(r["setting"] for r in rows):
            mine = [r for r in rows if r["extra_load"] == load and r["setting"] == setting]
            if not mine:
                continue
            entry = {"extra_load": load, "setting": setting, "repeats": len(mine),
                     "loadavg_1min": [round(r["loadavg_1min_before"], 2) for r in mine]}
            for key in ("warmstart_s_per_step", "grpo_s_per_step"):
                values = [r[key] for r in mine]
                entry[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
            out.append(entry)
    return out


def plot(result: dict, path: Path) -> None:
    """Every repeat as a point (seconds per step) for each setting, quiet and loaded side by side, one
    panel per measured part (log scale); the line through each setting's points is their median."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    loads = sorted({r["extra_load"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    fig.set_label("cpu_threads")
    for ax, key, title in zip(axes, ("warmstart_s_per_step", "grpo_s_per_step"),
                              ("Warm-start step (tiny model SFT)", "GRPO step (demo defaults, hf engine)")):
        for j, load in enumerate(loads):
            for i, setting in enumerate(settings):
                values = [r[key] for r in rows if r["setting"] == setting and r["extra_load"] == load]
                x = i + (j - (len(loads) - 1) / 2) * 0.3
                loads_seen = [r["loadavg_1min_before"] for r in rows if r["extra_load"] == load]
                ax.plot([x] * len(values), values, "o", color=f"C{j}", alpha=0.7,
                        label=f"+{load} busy loops (load average {min(loads_seen):.1f}-{max(loads_seen):.1f})"
                        if i == 0 else None)
                if values:
                    ax.plot([x - 0.1, x + 0.1], [statistics.median(values)] * 2, "-", color=f"C{j}", lw=2)
        ax.set_xticks(range(len(settings)), [f"threads: {s}" for s in settings])
        ax.set_yscale("log")   # quiet and loaded times differ by decades
        ax.set(ylabel="seconds per step (each repeat a point)")
        ax.set_title(title, loc="left")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(frameon=False)
    fig.suptitle(f"{result['machine']['cpus']} CPUs; load averages per repeat in the JSON", x=0.01, ha="left")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load", type=int, nargs="+", default=[0, 2], help="busy-loop processes beside it")
    parser.add_argument("--settings", nargs="+", default=["1", "2", "default", "2-passive"])
    parser.add_argument("--warm-steps", type=int, default=15)
    parser.add_argument("--grpo-steps", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_threads.json"))
    parser.add_argument("--plot-only", action="store_true", help="redraw the figure from the JSON")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.warm_steps, args.grpo_steps)))
        return 0
    rows = []
    for load in args.load:
        busy = under_load(load)
        try:
            for repeat in range(args.repeats):
                for setting in args.settings:
                    row = {"extra_load": load, "repeat": repeat, **measure(setting, args.warm_steps, args.grpo_steps)}
                    rows.append(row)
                    print(f"load +{load} {setting:>10}: warm-start {row['warmstart_s_per_step']:.3f} s/step, GRPO "
                          f"{row['grpo_s_per_step']:.2f} s/step (load average {row['loadavg_1min_before']:.2f})",
                          flush=True)
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()
    import torch
    result = {"machine": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                          "processor": platform.processor() or platform.machine(),
                          "python": platform.python_version(), "torch": torch.__version__},
              "date": time.strftime("%Y-%m-%d %H:%M"), "warm_steps": args.warm_steps, "grpo_steps": args.grpo_steps,
              "note": "extra_load = busy-loop processes started beside the measurement; loadavg_1min is the "
                      "machine's 1-minute load average when each repeat started (other users included)",
              "summary": summary(rows), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    plot(result, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} and its figure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
