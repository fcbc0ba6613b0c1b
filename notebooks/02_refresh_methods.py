# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # File vs tensor vs merged refresh
#
# **What it shows.** After each optimizer step the trainer's adapter must reach the rollout engine.
# Three ways, each timed part by part on a real engine:
#
# | mode | what moves | parts |
# |---|---|---|
# | `file` | the adapter, as a PEFT dir on tmpfs | snapshot, stage to the host, write, unload, load by path |
# | `tensor` | the adapter, as tensors (CUDA IPC on a GPU) | snapshot, stage per bucket, unload, load |
# | `inplace` | the adapter, written into the engine's resident copy (SGLang: its GPU LoRA pool) | snapshot, stage, write |
# | `merged` | every base weight, W + (α/r)·B·A | merge, push per bucket |
#
# Measured over bucket sizes (log scale, from below the adapter's size to 512 MB) and adapter
# ranks, and drawn against the physical floor: the bytes moved divided by the measured copy
# bandwidth. On a CPU this runs the `hf` reference engine, and every figure says so: the shapes of
# the curves are real, the absolute numbers are not SGLang's. The last section plots the GPU
# results (SGLang on an H200) committed by the benchmarks.
#
# **How long.** CPU (2 cores), defaults: ~30 s. GPU (one H200) with `ENGINE="sglang"` on the tiny
# model, ranks 8 and 32, 4 bucket sizes: 76 s in a Jupyter kernel, engine start included
# (`bash scripts/gpu_notebooks.sh`; figures in `benchmarks/results/gpu/notebook02_sglang_*.png`).
# Tiny-model refreshes there take 7-14 ms (inplace fastest); merged pushes 12-95 ms, by bucket size.

# %%
# setup
# %load_ext autoreload
# %autoreload 2
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from lorabench import refresh_bench as rb
from lorabench.config import Config
from lorabench.models import resolve_model_path
from lorabench.viz import plot_refresh_summary, refresh_sweep_figure

# %% tags=["parameters"]
ENGINE = "hf"                 # "hf" (CPU or GPU) | "sglang" (GPU)
MODEL = "tiny"                # "tiny" | "Qwen/Qwen3-0.6B"
RANKS = [4, 16]               # adapter ranks; the tiny model's r=16 adapter is 1 MB, its full weights ~10 MB
BUCKETS_MB = [0.01, 0.1, 1, 16, 512]   # e.g. rb.BUCKETS_MB for the full log-spaced sweep
REPEATS = 3                   # timed refreshes per point (the median is kept), after one untimed
GPU_RESULTS = "../benchmarks/results/gpu"
SAVE_TO = ""                  # e.g. "../runs/refresh_cpu.json" to keep the rows
EXTRA = []                    # engine overrides, e.g. "engine.attention_backend=triton"

# %%
if ENGINE == "sglang":
    import nest_asyncio
    nest_asyncio.apply()
from lorabench.engines import make_engine

# the refresh cost does not depend on what the model learned: no warm-start needed
cfg = Config.load(None, [f"engine.backend={ENGINE}", f"model.name_or_path={MODEL}", "warmstart.steps=0",
                         f"lora.r={max(RANKS)}", *EXTRA])
model_path = resolve_model_path(cfg)
engine = make_engine(cfg, model_path)   # a scratch engine: merged refresh overwrites its base weights
label = rb.engine_label(engine)
bandwidth = rb.measure_bandwidth(str(getattr(engine, "device", "cpu")))
print(f"{label}; measured copy bandwidth {bandwidth:.1f} GB/s")

# %% [markdown]
# ## The sweep
# One row per (mode, rank, bucket size): the median refresh and its parts.

# %%
rows = rb.sweep(engine, model_path, ranks=RANKS, buckets_mb=BUCKETS_MB, repeats=REPEATS)
table = pd.DataFrame([{**{k: r[k] for k in ("mode", "rank", "bucket_mb", "buckets")}, "MB": r["bytes"] / 2**20,
                       **{f"{p} ms": 1e3 * s for p, s in r["parts"].items()}, "total ms": 1e3 * r["total_s"],
                       "x floor": r["total_s"] / rb.floor_seconds(r["bytes"], bandwidth)} for r in rows])
table.round(3)

# %% [markdown]
# ## Latency per bucket size, parts stacked, against the floor
# Rows of panels are adapter ranks, columns are modes. The dashed line is the floor: the bytes
# moved once at the measured copy bandwidth. The y axis is logarithmic (so the floor is visible):
# bar tops are the totals; segment heights are not proportional to their share (see the table).

# %%
fig = refresh_sweep_figure(rows, bandwidth, label=label)

# %% [markdown]
# What to read off it:
# - `file` and `tensor` move the adapter only (MB scale); `merged` moves every weight, so its
#   floor is higher and its cost grows with the model, not the rank;
# - the bucket size changes the number of pushes (merged) or staging copies (tensor); `file`
#   writes one file whatever the bucket size, so its bars are flat;
# - on the `hf` engine, load (PEFT re-wrapping the model) dominates and sits orders of magnitude
#   above the floor: the overhead is software, not bytes.
#
# Checks on the measurements themselves (physics and bookkeeping), so a broken sweep fails here:

# %%
for r in rows:
    assert abs(sum(r["parts"].values()) - r["total_s"]) < 1e-9, r          # the parts make the total
    assert r["total_s"] > rb.floor_seconds(r["bytes"], bandwidth), r       # nothing beats the floor
adapter_mb = {r["rank"]: r["bytes"] for r in rows if r["mode"] == "tensor"}
assert all(r["bytes"] > max(adapter_mb.values()) for r in rows if r["mode"] == "merged")
assert sorted(adapter_mb) == sorted(RANKS) and adapter_mb[max(RANKS)] > adapter_mb[min(RANKS)]
for r in rows:
    if r["mode"] != "file" and r["bucket_mb"] * 2**20 < r["bytes"]:
        assert r["buckets"] > 1, f"a {r['bucket_mb']} MB bucket must split {r['bytes']} bytes: {r}"
if SAVE_TO:
    print(rb.save_results(SAVE_TO, rows, bandwidth, engine=label))
engine.close()

# %% [markdown]
# ## The GPU results committed by the benchmarks
# Refresh sweeps in this notebook's format (`"kind": "refresh_sweep"`) are plotted like the one
# above; per-step refresh records of the committed GRPO runs (SGLang 0.5.17 on an H200) are
# summarised as medians per file and mode. These were measured on the GPU machine, not here.

# %%
gpu_dir = Path(GPU_RESULTS)
for path in sorted(gpu_dir.glob("*.json")):
    sweep_file = rb.load_results(path)
    if sweep_file:
        refresh_sweep_figure(sweep_file["rows"], sweep_file.get("bandwidth_gbps"),
                             label=f"{path.name}: {sweep_file.get('engine', '')}")
summary = rb.gpu_refresh_summary(gpu_dir)
if summary:
    ax = plot_refresh_summary(summary)
    ax.set_title(f"Committed GPU results: {summary[0].get('gpu', 'GPU')}, SGLang {summary[0].get('sglang', '')} "
                 "(median per step)", fontsize=9)
    plt.show()
pd.DataFrame([{"source": s["source"], "mode": s["mode"], "steps": s["steps"], "MB": s["bytes"] / 2**20,
               **{f"{p} ms": 1e3 * v for p, v in s["parts"].items()}, "total ms": 1e3 * s["total_s"]}
              for s in summary]).round(2)
