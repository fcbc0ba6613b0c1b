"""How long a lesson takes: Run All of a notebook at its learner defaults in a fresh kernel
(papermill), with the tiny model cached or from an empty cache, on the machine as it is or with
busy-loop processes beside it; the wall time, each cell's time and the load average before and
after, so a stated time can say how it was measured.

    python benchmarks/notebook_times.py notebooks/01_step_through.ipynb [--cold] [--load 2] [--param K=V ...]

--cold: an empty LORABENCH_CACHE (the tiny model is built and warm-started in the run);
--load K: K busy-loop processes run for the measurement and are ended after it;
--param: a parameter injected papermill's way (a Python literal), e.g. CLOSE_AT_END=True;
--keep PATH: also write the executed notebook to PATH.
Appends one row to benchmarks/results/notebook_times.json (a list of runs).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebook")
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--load", type=int, default=0)
    parser.add_argument("--param", nargs="*", default=[])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "notebook_times.json"))
    parser.add_argument("--keep", help="also write the executed notebook here (to read its outputs)")
    args = parser.parse_args()
    import papermill
    params = {k: ast.literal_eval(v) for k, v in (p.split("=", 1) for p in args.param)}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.cold:
                os.environ["LORABENCH_CACHE"] = str(Path(tmp) / "cache")
            params.setdefault("RUN_ROOT", str(Path(tmp) / "runs"))
            load_before = os.getloadavg()
            t0 = time.perf_counter()
            nb = papermill.execute_notebook(args.notebook, str(Path(tmp) / "out.ipynb"), parameters=params,
                                            cwd=str(Path(args.notebook).resolve().parent), progress_bar=False,
                                            kernel_name="python3")
            wall = time.perf_counter() - t0
            load_after = os.getloadavg()
            if args.keep:
                shutil.copyfile(Path(tmp) / "out.ipynb", args.keep)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    cells = [{"cell": i, "first_line": c.source.splitlines()[0][:80] if c.source else "",
              "seconds": round(c.metadata.get("papermill", {}).get("duration") or 0.0, 2)}
             for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    row = {"notebook": Path(args.notebook).name, "date": time.strftime("%Y-%m-%d %H:%M"),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip(),
           "uncommitted_changes": bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                                      cwd=ROOT, capture_output=True, text=True).stdout.strip()),
           "cpus": len(os.sched_getaffinity(0)), "cold_cache": args.cold, "extra_load": args.load,
           "parameters": {k: v for k, v in params.items() if k != "RUN_ROOT"},
           "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
           "wall_s": round(wall, 1), "cells": [c for c in cells if c["seconds"] >= 1.0]}
    out = Path(args.out)
    runs = json.loads(out.read_text()) if out.is_file() else []
    out.write_text(json.dumps([*runs, row], indent=1))
    print(f"{row['notebook']}: {wall:.0f} s ({'cold' if args.cold else 'warm'} cache, +{args.load} busy loops, "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
