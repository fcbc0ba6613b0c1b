"""Exploration: held-out accuracy of the warm-started tiny model vs warm-start length and batch
(GPU, hf engine). One JSON line per setting to $OUT/scan.jsonl; cited by the research log."""
import json
import os
import time

from lorabench.engines.hf import HFEngine
from lorabench.session import build_trainer
from lorabench.session.config import Config
from lorabench.tiny import tiny_model_dir

SETTINGS = [["warmstart.steps=350"], ["warmstart.steps=400"], ["warmstart.steps=450"],
            ["warmstart.steps=500", "warmstart.batch_size=16"], ["warmstart.steps=700", "warmstart.batch_size=16"]]

out = open(os.path.join(os.environ.get("OUT", "."), "scan.jsonl"), "a")
for over in SETTINGS:
    cfg = Config.load(None, over + ["data.eval_size=256", "engine.hf.device=cuda"])
    t = time.perf_counter()
    path = str(tiny_model_dir("/tmp/lorabench-cache", cfg.warmstart, 0))
    t_ws = time.perf_counter() - t
    engine = HFEngine(path, device="cuda", dtype=cfg.model.dtype)
    tr = build_trainer(cfg, path, engine, log=lambda *a: None)
    sampled, greedy = tr.evaluate(), tr.evaluate(greedy=True)
    row = {"settings": over, "warmstart_s_gpu": round(t_ws, 1), "flexible_T0.7": sampled["flexible"],
           "strict_T0.7": sampled["strict"], "flexible_greedy": greedy["flexible"]}
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()
