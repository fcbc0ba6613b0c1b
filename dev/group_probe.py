"""Where a policy group's step on SGLang spends its time, or where it waits (GPU machine only).

    bash .sglang/with-sglang.sh python dev/group_probe.py --k 4 --size 16x8x128 --mode inplace --limit 240

Opens the group as `lorabench run` does (GroupSession.open, the GPU setting of benchmarks/group_step.py,
grpo.compile=off), then takes its steps phase by phase: each policy's rollout request, the one engine
batch, each policy's update + refresh + commit. Every phase prints a line with its elapsed time; a
watchdog (benchmarks/watch.py) prints every 10 s of a phase and, past a phase's deadline or the run's
--limit, every thread's stack here and in the engine's processes, then exits 3.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--size", default="16x8x128")
    parser.add_argument("--mode", default="inplace")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--limit", type=float, default=240, help="the whole run stops itself after this many s")
    parser.add_argument("--out", default="")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import watch
    from group_step import GPU_SETTING, LRS, size_overrides
    from synthetic import STACK, qwen3_06b_run

    from lorabench.engines.base import generate_each
    from lorabench.rollout import rollouts_of
    from lorabench.session import Config, GroupSession
    watch.limit(args.limit)
    watch.stacks_in_children()
    root = Path(tempfile.mkdtemp(prefix="group-probe-"))
    with watch.phase("model and data", 120):
        base = [*STACK, *GPU_SETTING, *qwen3_06b_run(root, os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"),
                                                     "group-probe")]
    entries = [{"name": f"lr{i}", "grpo": {"lr": LRS[i]}} for i in range(args.k)]
    cfg = Config.load(None, [*base, *size_overrides(args.size), f"refresh.mode={args.mode}", "grpo.compile=off",
                             f"policies={json.dumps(entries)}", f"run.out_dir={root}", "run.name=group",
                             *args.overrides])
    with watch.phase("GroupSession.open", 200):
        session = GroupSession.open(cfg, log=watch.say, evaluate_first=False)
    watch.engine = session.engine
    args_ = session.engine.engine.server_args
    watch.say("engine: " + ", ".join(f"{k}={getattr(args_, k, '?')}" for k in (
        "max_loras_per_batch", "cuda_graph_max_bs", "cuda_graph_max_bs_decode", "max_running_requests",
        "chunked_prefill_size", "lora_backend")))
    group, out = session.trainer, {"steps": []}
    try:
        for step in range(1, args.steps + 1):
            row = {}
            with watch.phase(f"step {step}: rollout requests", 30):
                asked = {name: t.rollout_request() for name, t in group.trainers.items()}
            n = sum(len(r.prompt_ids) for _, r in asked.values())
            t0 = time.perf_counter()
            with watch.phase(f"step {step}: one engine batch of {n} prompts", 90):
                done = generate_each(session.engine, [r for _, r in asked.values()])
            row["rollout_s"] = time.perf_counter() - t0
            for (name, (problems, request)), completions in zip(asked.items(), done):
                trainer = group.trainers[name]
                t0 = time.perf_counter()
                with watch.phase(f"step {step}: {name} update, refresh, commit", 60):
                    rollouts = rollouts_of(session.engine, trainer.tokenizer, problems, request, completions)
                    record = trainer.step(rollouts, row["rollout_s"])
                row[name] = {k: record.metrics[k] for k in ("time/train_s", "time/refresh_s", "mismatch/mean",
                                                            "adapter/served_version") if k in record.metrics}
                row[name]["wall_s"] = time.perf_counter() - t0
            out["steps"].append(row)
            watch.say(f"step {step}: {json.dumps(row)}")
        with watch.phase("commits", 60):
            group.wait_committed()
    finally:
        with watch.phase("close", 90):
            session.close()
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
