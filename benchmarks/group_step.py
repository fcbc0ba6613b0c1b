"""K policies on one engine against one policy alone, through the user's path: `GroupSession.open`
(what `lorabench run` does with a `policies` list) beside `RunSession.open` at the same setting,
each step timed from outside.

    python benchmarks/group_step.py --out results/gpu/group_step.json                 # the H200 setting
    python benchmarks/group_step.py --tiny --sizes 2x4x16 --out /tmp/group_step_cpu.json   # CPU, the script's check

GPU setting: a random-init model of Qwen3-0.6B's shape in bf16, LoRA r=32 alpha=64, refresh.mode=inplace,
temperature 1, the engine arguments of the SGLang stack (step_gpu.STACK). K policies differ in their
learning rate only (same rank: the same work per policy). Per size PxGxT (prompts x group x new
tokens, per policy) and group size K (--ks): p50 of steps 2..n of the group's step and of one
policy's, the ratio to K single steps, where each policy's step goes (time/<part>_s), each step's CPU seconds
per thread of this process (the trainer's thread shares the GIL with the engine's), each policy's
trainer-vs-engine mismatch (mean, max) and served versions, the device memory in use (all
processes: trainer + engine) with the group and with one policy. --group-overrides set the group
alone (grpo.max_staleness=1: its next batch sampled while its updates run). Every phase prints a line with its
time and stops the run if it overruns (watch.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import watch  # noqa: E402  (this folder)
from meters import trainer_context  # noqa: E402
from synthetic import size_overrides  # noqa: E402

from lorabench.session import Config, GroupSession, RunSession  # noqa: E402

GPU_SETTING = ["lora.r=32", "lora.alpha=64", "refresh.mode=inplace", "grpo.temperature=1.0"]
LRS = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]


def device_used_gb() -> float:
    if not torch.cuda.is_available():
        return float("nan")
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 1e9


PARTS = ("rollout", "reward", "train", "group_wait", "refresh", "probe", "log")   # time/<part>_s of a step


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds used so far by each thread of this process (Linux), by Python thread name (else the OS's):
    the trainer's thread and the engine's share one GIL, so what the others use delays the trainer's."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    used: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = names.get(int(task.name)) or (task / "comm").read_text().strip()
        except FileNotFoundError:   # the thread ended meanwhile
            continue
        used[name] = used.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


def timed(step, n: int, what: str, deadline_s: float) -> tuple[list[float], list, list[dict]]:
    """Walls, records and each step's CPU seconds per thread (thread_cpu_s) of `n` steps."""
    walls, records, cpu = [], [], []
    for i in range(n):
        t0, before = time.perf_counter(), thread_cpu_s()
        with watch.phase(f"{what} step {i + 1}", deadline_s):
            records.append(step())
        walls.append(time.perf_counter() - t0)
        after = thread_cpu_s()
        cpu.append({name: round(after[name] - before.get(name, 0.0), 3) for name in after
                    if after[name] - before.get(name, 0.0) >= 0.02})
    return walls, records, cpu


def parts_p50(rows: list[dict]) -> dict[str, float]:
    """p50 of each part of a policy's step (time/rollout_s of a group's step is the shared batch's)."""
    return {part: statistics.median(r.get(f"time/{part}_s", 0.0) for r in rows) for part in PARTS}


def engine_ms_p50(refreshes: list) -> dict[str, float]:
    """p50 of each timing an in-place refresh reports (RefreshRecord.engine_ms: the engine's own apply, our
    stage, request and reply, in ms); {} for other modes."""
    keys = sorted({key for r in refreshes for key in r.engine_ms})
    return {key: statistics.median(r.engine_ms.get(key, 0.0) for r in refreshes) for key in keys}


def run_group(base: list[str], k: int, size: str, root: Path, steps: int, extra: list[str] = (),
              name: str = "") -> dict:
    """A new group in a dir of its own (`name`): an existing one would be continued, not measured afresh."""
    entries = [{"name": f"lr{i}", "grpo": {"lr": LRS[i]}} for i in range(k)]
    cfg = Config.load(None, [*base, *size_overrides(size), *extra, f"policies={json.dumps(entries)}",
                             f"run.out_dir={root}", f"run.name={name or f'group{k}-{size}'}"])
    t0 = time.perf_counter()
    with watch.phase(f"K={k} {size}: GroupSession.open", 300):
        session = GroupSession.open(cfg, log=lambda *a: None, evaluate_first=False)
    watch.engine = session.engine
    try:
        opened = time.perf_counter() - t0
        walls, records, cpu = timed(session.trainer.step, steps, f"K={k} {size}", 60 + 4 * k * _size_s(size))
        session.trainer.wait_committed()
        used = device_used_gb()
        rows = {name: [r[name].metrics for r in records] for name in records[0]}
    finally:
        with watch.phase(f"K={k} {size}: close", 120):
            session.close()
    later = {name: policy_rows[1:] for name, policy_rows in rows.items()}
    return {"open_s": opened, "first_step_s": walls[0], "step_wall_s_p50": statistics.median(walls[1:]),
            "step_wall_s": walls, "device_used_gb": used, "thread_cpu_s": cpu,
            "rollout_s_p50": statistics.median(r["time/rollout_s"] for r in later["lr0"]),
            "per_policy": {name: {"mismatch_mean_p50": statistics.median(r["mismatch/mean"] for r in policy_rows),
                                  "mismatch_mean_per_step": [r["mismatch/mean"] for r in rows[name]],
                                  "mismatch_max_per_step": [r["mismatch/max"] for r in rows[name]],
                                  "mismatch_max": max(r["mismatch/max"] for r in policy_rows),
                                  "served_versions": [r["adapter/served_version"] for r in rows[name]],
                                  "lags": [r.get("adapter/lag", 0) for r in rows[name]],   # on-policy rows have none
                                  "parts_s_p50": parts_p50(policy_rows),
                                  "refresh_engine_ms_p50": engine_ms_p50([r[name].refresh for r in records[1:]])}
                           for name, policy_rows in later.items()}}


def run_single(base: list[str], size: str, root: Path, steps: int) -> dict:
    cfg = Config.load(None, [*base, *size_overrides(size), f"grpo.lr={LRS[0]}", f"run.out_dir={root}",
                             f"run.name=single-{size}"])
    with watch.phase(f"one policy {size}: RunSession.open", 300):
        session = RunSession.open(cfg, log=lambda *a: None, evaluate_first=False)
    watch.engine = session.engine
    try:
        walls, records, cpu = timed(session.trainer.step, steps, f"one policy {size}", 60 + 4 * _size_s(size))
        session.trainer.wait_committed()
        used = device_used_gb()
    finally:
        with watch.phase(f"one policy {size}: close", 120):
            session.close()
    later = [r.metrics for r in records[1:]]
    return {"first_step_s": walls[0], "step_wall_s_p50": statistics.median(walls[1:]), "step_wall_s": walls,
            "device_used_gb": used, "thread_cpu_s": cpu,
            "rollout_s_p50": statistics.median(r["time/rollout_s"] for r in later),
            "parts_s_p50": parts_p50(later), "mismatch_mean_p50": statistics.median(r["mismatch/mean"] for r in later),
            "mismatch_max": max(r["mismatch/max"] for r in later),
            "served_versions": [r.metrics["adapter/served_version"] for r in records],
            "refresh_engine_ms_p50": engine_ms_p50([r.refresh for r in records[1:]])}


def _size_s(size: str) -> float:
    """A generous bound on one policy's step at `size` on an H200 (the watchdog's deadline), in s."""
    p, g, t = (int(x) for x in size.split("x"))
    return 2.0 + p * g * t / 20_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the hf engine (CPU)")
    parser.add_argument("--k", type=int, default=4, help="policies in the group")
    parser.add_argument("--sizes", nargs="+", default=["16x8x128", "64x8x256"], help="PxGxT per policy")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cache", default=os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"))
    parser.add_argument("--ks", type=int, nargs="+", default=None, help="group sizes to run (default: --k)")
    parser.add_argument("--limit", type=float, default=560, help="the run stops itself after this many seconds")
    parser.add_argument("--overrides", nargs="*", action="extend", default=[],
                        help="for both runs; given twice, both lists count (gpu_session.sh's sampler part adds one)")
    parser.add_argument("--group-overrides", nargs="*", default=[],
                        help="for the group only, e.g. grpo.max_staleness=1 against one policy at the defaults")
    parser.add_argument("--engine-sm-percents", type=int, nargs="+", default=[100],
                        help="under CUDA MPS: the group's engine (its scheduler) gets this share of the SMs, one "
                             "group run per value; the trainer keeps all of them (its CUDA context exists first). "
                             "60%% on the H200 was slower than 100%% and its mismatch rose 3.5-8x (docs/results.md, "
                             "section 2)")
    parser.add_argument("--no-group", action="store_true",
                        help="one policy only at each size (e.g. a second sampler's single step in the same call)")
    parser.add_argument("--single-p50", type=float, default=0.0,
                        help="one policy's step p50 (s) from an earlier run in the same call: no single run here")
    parser.add_argument("--trainer-below-normal", action="store_true",
                        help="under CUDA MPS: this process (the trainer) is a BELOW_NORMAL client "
                             "(CUDA_MPS_CLIENT_PRIORITY=1): where both have kernels ready, the engine's run first")
    args = parser.parse_args()
    trainer_context(below_normal=args.trainer_below_normal)
    watch.limit(args.limit)
    watch.stacks_in_children()
    root = Path(tempfile.mkdtemp(prefix="group-step-"))
    if args.tiny:
        base = ["model.name_or_path=tiny", "data.eval_size=2"]
    else:
        from synthetic import STACK, qwen3_06b_run
        base = [*STACK, *GPU_SETTING, *qwen3_06b_run(root, args.cache, "group-bench")]
    base += args.overrides
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "commit": os.environ.get("LORABENCH_COMMIT", ""),
              "date": time.strftime("%Y-%m-%d %H:%M"), "ks": args.ks or [args.k], "overrides": base,
              "group_overrides": args.group_overrides,
              "trainer_below_normal": args.trainer_below_normal, "sizes": {}}
    for size in args.sizes:
        single = {"step_wall_s_p50": args.single_p50, "given": True} if args.single_p50 else \
            run_single(base, size, root / "runs", args.steps)
        result["sizes"][size] = {"single": single}
        Path(args.out).write_text(json.dumps(result, indent=1))   # a group cut off by the limit keeps this
        ks = [] if args.no_group else args.ks or [args.k]
        for k, share in [(k, share) for k in ks for share in args.engine_sm_percents]:
            # read by the CUDA context the engine's scheduler makes when it starts; the trainer's exists already
            os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(share)
            key = f"group_k{k}" + ("" if share == 100 else f"_engine_sm{share}")
            group = run_group(base, k, size, root / "runs", args.steps, args.group_overrides, f"{key}-{size}")
            os.environ.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
            result["sizes"][size][key] = {
                **group, "engine_sm_percent": share,
                "vs_one_step": group["step_wall_s_p50"] / single["step_wall_s_p50"],
                "vs_k_steps": group["step_wall_s_p50"] / (k * single["step_wall_s_p50"])}
            ratios = result["sizes"][size][key]
            floor = single.get("mismatch_mean_p50") or float("nan")
            for name, policy in group["per_policy"].items():   # no adapter moves on the random model: a gap is wrong
                if max(policy["mismatch_mean_per_step"]) > 2 * floor:
                    watch.say(f"{size} K={k}, engine SMs {share}%: {name}'s trainer-vs-engine mismatch "
                              f"{max(policy['mismatch_mean_per_step']):.4f} is above twice one policy's {floor:.4f}")
            watch.say(f"{size} K={k}, engine SMs {share}%: step p50 {group['step_wall_s_p50']:.2f} s vs one policy's "
                      f"{single['step_wall_s_p50']:.2f} s ({ratios['vs_one_step']:.2f}x; {ratios['vs_k_steps']:.2f}x "
                      f"of {k} single steps)")
            Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
