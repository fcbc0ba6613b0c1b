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
# # Four ways to refresh an adapter
#
# **What it shows.** After each optimizer step the trainer's adapter must reach the rollout engine.
# lorabench has four ways (`refresh.mode`), each timed part by part:
#
# | mode | what moves | parts |
# |---|---|---|
# | `file` | the adapter, as a PEFT directory on tmpfs | snapshot, stage (copy to the host), write the directory, unload, load it by path |
# | `tensor` | the adapter, as tensors (CUDA IPC on a GPU) | snapshot, stage (copy on the engine's device), unload, load from tensors |
# | `inplace` | new values into the adapter the engine already holds (SGLang: its GPU LoRA pool) | snapshot, write |
# | `merged` | every base weight, as W + (α/r)·B·A | snapshot, merge, push (one engine call per bucket) |
#
# *Snapshot* is the trainer side: the LoRA layers copied into one flat buffer, made once per step.
# Three questions, one figure each, measured here on a real engine: which mode is fastest end to
# end (and where its time goes), how the bucket size changes a merged push, and how far each is
# from the floor (the bytes moved once at the measured copy bandwidth). On a CPU the engine is the
# `hf` reference engine, so the absolute numbers are not SGLang's; with `ENGINE = "sglang"` on a GPU
# they are SGLang's; the last section says what they show there.
#
# **How long.** On a CPU (2 cores), these defaults: about 15 seconds (14 s measured for Run All in
# a fresh kernel; 12 s with an empty model cache: a refresh needs no trained model, so the tiny
# model is built without warm-start, in about a second). On a GPU (one H200, `ENGINE = "sglang"`,
# Run All in a fresh Jupyter kernel) with a model of Qwen3-0.6B's shape, `RANK = 32` and merged
# buckets from 1 MB to 2 GB: 1.5-2.5 minutes (80, 114 and 137 s measured; about 40 s of it starts the engine).

# %%
# setup
# %load_ext autoreload
# %autoreload 2
import pandas as pd

from lorabench import explain, viz
from lorabench import refresh_bench as rb
from lorabench.session import Config, resolve_model, start_engine
from lorabench.widgets import setup_notebook, sglang_in_notebook

setup_notebook()

# %% tags=["parameters"]
ENGINE = "hf"         # "hf": transformers + PEFT, CPU or GPU | "sglang": in-process sglang.Engine (GPU)
MODEL = "tiny"        # "tiny" (weights ~10 MB) | "Qwen/Qwen3-0.6B" or a local model dir
RANK = 16             # LoRA rank on every linear layer (the demo's lora.r); alpha is twice the rank
BUCKET_MB = 64        # bucket size for the comparison of modes (the default refresh.bucket_mb)
MERGED_BUCKETS_MB = [0.01, 0.03, 0.1, 0.3, 1, 4, 16]   # bucket sizes for the merged push
REPEATS = 10          # timed refreshes per point, after one untimed; figures show the median
SAVE_TO = ""          # e.g. "../runs/refresh_cpu.json" to keep the measured rows
# engine settings, e.g. ["engine.sglang.attention_backend=triton"]
OVERRIDES = []

# %%
if ENGINE == "sglang":   # its progress bars go to a log file, not here
    OVERRIDES = [*sglang_in_notebook(), *OVERRIDES]

# what the adapter has learned does not change what a refresh costs: no warm-start needed
cfg = Config.load(None, [f"engine.backend={ENGINE}", f"model.name_or_path={MODEL}", "warmstart.steps=0",
                         f"lora.r={RANK}", *OVERRIDES])
model_path = resolve_model(cfg)
engine = start_engine(cfg, model_path)  # a scratch engine: a merged refresh overwrites its base weights
trainer_model = rb.adapter_model(model_path, RANK, dtype=cfg.model.dtype, device=str(engine.device))
label = rb.engine_label(engine)
bandwidth = rb.measure_bandwidth(str(engine.device))
print(f"{label}; measured copy bandwidth {bandwidth:.1f} GB/s")

# %% [markdown]
# ## 1. Which mode is fastest end to end?
# Each mode refreshes the same rank-`RANK` adapter `REPEATS` times (merged last: it overwrites the
# engine's base weights). Left, end to end: the median refresh call and, after it, the first
# request with the new adapter (one prompt, one token), fastest on top, each mode's floor as a
# black tick (far left: too short to see at this scale). Right: the calls split into their parts,
# on a linear axis so that the parts' lengths compare.

# %%
rows = [rb.measure_refresh(engine, trainer_model, mode, BUCKET_MB, REPEATS) for mode in rb.MODES]
fig = viz.refresh_modes_figure(rows, bandwidth, label=f"{label}: LoRA r={RANK}, {BUCKET_MB:g} MB buckets")

# %%
pd.DataFrame([{"mode": r["mode"], "MB moved": r["bytes"] / 2**20, "call ms": 1e3 * r["total_s"],
               "first request ms": 1e3 * r["first_request_s"], "floor ms": 1e3 * rb.floor_seconds(r["bytes"], bandwidth),
               "× floor": r["total_s"] / rb.floor_seconds(r["bytes"], bandwidth)} for r in rows]).set_index("mode").round(3)

# %% [markdown]
# What to read off it:
# - `file` and `tensor` end the same way, with an unload and a load: the engine builds the adapter
#   anew every step, and that load is most of their time (on the `hf` engine: PEFT wrapping the
#   model's linear layers again). `file` also writes a directory and the engine reads it back.
# - `inplace` skips both: the engine keeps the adapter it loaded first and only the values change.
# - `merged` moves the full weights of every adapted layer, not only the adapter, so its bytes grow
#   with the model (every weight on its first push; after that the rest never changes); afterwards
#   the engine has no base model left (it serves W + ΔW as its base, and decodes without LoRA
#   kernels). With the tiny model that is a few MB and cheap; section 3 says how it goes at 0.6B scale.
# - `× floor` says how far each mode is from moving its bytes once. Every mode is well above it:
#   what costs is software (Python calls, per-tensor work, the engine's bookkeeping), not bytes.

# %% [markdown]
# ## 2. How does the bucket size change a merged push?
# A merged refresh pushes the weights in buckets of at most `bucket_mb` MB (whole tensors, sorted
# by name; the cache is flushed once, after the last). Each bucket is one engine call. Left: the
# median merged refresh per bucket size (the number above each point is the pushes it took).
# Right: the same points against the number of pushes, with a straight-line fit.

# %%
merged = [rb.measure_refresh(engine, trainer_model, "merged", mb, REPEATS) for mb in MERGED_BUCKETS_MB]
fig = viz.merged_buckets_figure(merged, bandwidth, label=f"{label}: {merged[0]['bytes'] / 2**20:.1f} MB of weights")

# %% [markdown]
# The bytes are the same at every bucket size; what changes is the number of pushes, and the time
# follows it along a line. Its slope is what one engine call costs (on the `hf` engine: a walk
# over the model's parameter names and a checked copy per tensor; on SGLang: a request round trip
# and `load_weights` over the bucket). The intercept is what does not depend on the pushes: the
# snapshot, the merge and the bytes themselves. With the tiny model on a CPU the pushes are cheap
# next to the merge, so the line is shallow; with a 0.6B model on a GPU (section 3) the pushes are
# most of the time. Either way the best bucket is the largest: the whole model in one or two pushes.

# %%
if SAVE_TO:
    print(rb.save_results(SAVE_TO, rows + merged, bandwidth, engine=label))
engine.close()

# %% [markdown]
# ## 3. On a GPU, with SGLang
# With `ENGINE = "sglang"` on a GPU, sections 1 and 2 measure SGLang itself. The lorabench
# repository's results page (`docs/results.md`) shows both figures from this notebook on an H200,
# with a random-init model of Qwen3-0.6B's shape in bf16 (the refresh cost depends on the shapes, not
# on the values) and `RANK = 32`. There `inplace` is the fastest end to end by far, and most of its
# time is the first request: the adapter keeps its name, so the engine flushes its prefix cache (KV
# computed with the old values must not be reused) and that request is a full prefill. `file` and
# `tensor` pay for SGLang building the adapter anew inside the call: the load is the largest part of
# their call (for `tensor`, SGLang's load copies each tensor to the host and stacks q/k/v there). A
# merged refresh moves every adapted weight of the model, and its pushes are most of its time at
# every bucket size.

# %% [markdown]
# ## Self-check
# The collapsed cell below checks the measurements themselves (bookkeeping and physics), so a
# broken measurement does not pass for a result.

# %% tags=["self-check"] jupyter={"source_hidden": true}
measured = rows + merged
adapter_bytes = max(r["bytes"] for r in rows if r["mode"] != "merged")
explain.self_check({
    "each refresh's parts add up to its total": all(abs(sum(r["parts"].values()) - r["total_s"]) < 1e-9 for r in measured),
    "no refresh beats the floor": all(r["total_s"] > rb.floor_seconds(r["bytes"], bandwidth) for r in measured),
    "merged moves more bytes than the adapter": all(r["bytes"] > adapter_bytes for r in merged),
    "the same bytes at every bucket size": len({r["bytes"] for r in merged}) == 1,
    "a bucket smaller than the weights splits the push":
        all(r["buckets"] > 1 for r in merged if r["bucket_mb"] * 2**20 < r["bytes"]),
})
