"""Exploration: which demo settings make held-out strict reward rise most (GPU, sglang engine).
Writes one JSON row per setting to $OUT/sweep.jsonl. Not a test; the research log cites it."""
import json
import os
import sys
import time

from lorabench.session import build_trainer, start_engine
from lorabench.session.config import Config
from lorabench.tiny import tiny_model_dir

STACK = ["engine.sglang.attention_backend=triton", "engine.sglang.grammar_backend=none",
         'engine.sglang.extra_args={"disable_prefill_cuda_graph": true}', "engine.sglang.dtype=bfloat16",
         "engine.sglang.mem_fraction_static=0.3", "data.eval_size=256"]
GROUPS = {  # warm-start settings -> list of GRPO settings
    "": [[], ["grpo.steps=60"], ["grpo.temperature=0.5"], ["grpo.lr=1.5e-3"], ["grpo.temperature=1.0"]],
    "warmstart.steps=500": [[], ["grpo.steps=60"]],
}


def main():
    out = open(os.path.join(os.environ.get("OUT", "."), "sweep.jsonl"), "a")
    for ws, runs in GROUPS.items():
        ws_over = [ws] if ws else []
        base = Config.load(None, STACK + ws_over)
        t = time.perf_counter()
        path = str(tiny_model_dir("/tmp/lorabench-cache", base.warmstart, 0))
        t_ws = time.perf_counter() - t
        with start_engine(base, path) as engine:
            for over in runs:
                cfg = Config.load(None, STACK + ws_over + over)
                tr = build_trainer(cfg, path, engine, log=lambda *a: None)
                before = tr.evaluate()
                rows = [tr.step().metrics for _ in range(cfg.grpo.steps)]
                after, greedy = tr.evaluate(), tr.evaluate(greedy=True)
                tr.close()
                row = {"warmstart": ws, "grpo": over, "warmstart_s": t_ws, "before": before["strict"],
                       "after": after["strict"], "after_flexible": after["flexible"], "after_format": after["format"],
                       "greedy_after": greedy["strict"], "before_flexible": before["flexible"],
                       "reward_curve": [round(r["reward/mean"], 3) for r in rows]}
                print(json.dumps({k: v for k, v in row.items() if k != "reward_curve"}), flush=True)
                out.write(json.dumps(row) + "\n")
                out.flush()


if __name__ == "__main__":
    sys.exit(main())
