# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
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
# | `merged` | every adapted base weight, as W + (α/r)·B·A | snapshot, merge, push (one engine call per bucket) |
#
# *Snapshot* is the trainer side: the LoRA layers copied into one flat buffer, made once per step.
# The lesson first shows how its timings are taken (section 0) and what "in place" means in the
# engine's memory (section 1), then asks three questions, one figure each, measured here on a real
# engine: which mode is fastest end to end and where its time goes, how the bucket size changes a
# merged push, and how the cost changes with the LoRA rank. Every timing is a set of repeats shown as
# points with their spread, and every sentence that states an order or a trend is computed from the
# numbers on screen. On a CPU the engine is the `hf` reference engine, so the absolute numbers are not
# SGLang's; with `ENGINE = "sglang"` on a GPU they are SGLang's.
#
# **How long.** On a CPU (2 cores, `ENGINE = "hf"`, these defaults, the tiny model cached): **0.5-2
# minutes**. Section 0's two-thread refreshes and the rank sweep take longest and stall when a core is busy;
# every measuring cell shows a progress bar with the time left. A refresh needs no trained model, so an empty
# model cache adds only the tiny model's build (seconds). On a GPU (one H200 or H100, `ENGINE = "sglang"`, a
# model of Qwen3-0.6B's shape, `RANK = 32`): **133-180 s**, about 40 s of it starting the engine (the rank
# sweep adds one model build per rank). Measured runs: docs/results.md, section 9.

# %%
# setup
# %load_ext autoreload
# %autoreload 2
import os

import pandas as pd
import torch
from IPython.display import Markdown, display

from lorabench import explain, viz
from lorabench import refresh_bench as rb
from lorabench.session import Config, resolve_model, start_engine
from lorabench.widgets import WaitProgress, setup_notebook, sglang_in_notebook

setup_notebook()

# %% tags=["parameters"]
ENGINE = "hf"         # "hf": transformers + PEFT, CPU or GPU | "sglang": in-process sglang.Engine (GPU)
MODEL = "tiny"        # "tiny" (weights ~10 MB) | "Qwen/Qwen3-0.6B" or a local model dir
RANK = 16             # LoRA rank on every linear layer (the demo's lora.r); alpha is twice the rank
BUCKET_MB = 64        # bucket size for the comparison of modes (the default refresh.bucket_mb)
MERGED_POINTS = 6     # bucket sizes for the merged push, chosen so that each gives a different push count
RANKS = [4, 8, 16, 32, 64]   # LoRA ranks for the cost-vs-rank sweep
REPEATS = 10          # timed refreshes per point, after one untimed; every one is shown
THREADS = 0           # torch CPU threads while timing sections 2-4 (0: the count section 0 finds steadiest)
SAVE_TO = ""          # e.g. "../runs/refresh_cpu.json" to keep the measured rows
# engine settings, e.g. ["engine.sglang.attention_backend=triton"]
OVERRIDES = []

# %%
if ENGINE == "sglang":   # its progress bars go to a log file, not here; it must hold the sweep's largest rank
    OVERRIDES = [*sglang_in_notebook(), f"engine.sglang.max_lora_rank={max([RANK, *RANKS])}", *OVERRIDES]

# what the adapter has learned does not change what a refresh costs: no warm-start needed
cfg = Config.load(None, [f"engine.backend={ENGINE}", f"model.name_or_path={MODEL}", "warmstart.steps=0",
                         f"lora.r={RANK}", *OVERRIDES])
threads_before = torch.get_num_threads()
with WaitProgress("starting the engine", expected_s=40 if ENGINE == "sglang" else 5):
    model_path = resolve_model(cfg)
    engine = start_engine(cfg, model_path)  # a scratch engine: a merged refresh overwrites its base weights
    trainer_model = rb.adapter_model(model_path, RANK, dtype=cfg.model.dtype, device=str(engine.device))
label = rb.engine_label(engine)
bandwidth, copy_mb = rb.fastest_copy_bandwidth(str(engine.device))   # for the floors below
print(f"{label}; fastest copy measured: {bandwidth:.1f} GB/s (copying {copy_mb} MB; of 1, 16 and 256 MB)")

# %% [markdown]
# ## 0. How these timings are taken
# torch splits a large copy or reduction over its CPU threads and waits for the last one. On a
# machine shared with other work, a thread that loses its core can stall the whole operation for
# longer than the operation itself; one thread has no one to wait for, but gets no help either.
# Which count is better depends on the machine and on its load now, so the lesson measures it: the
# same in-place refresh `REPEATS` times with one thread and with more, the counts taking turns so
# that each meets the same load (every repeat is a point; the bar is the middle half, the black tick
# the median). Sections 2-4 then time with the fewest threads whose upper quartile (typical time and
# spread in one number) is within 10% of the lowest, unless `THREADS` names a count; the count is set
# for each measurement and restored after.

# %%
cpus = len(os.sched_getaffinity(0))
thread_counts = sorted({1, min(2, cpus), cpus})
with WaitProgress("rounds over the thread counts") as progress:
    probe = rb.thread_probe(engine, trainer_model, thread_counts, REPEATS, progress=progress.counting(REPEATS))
fig = viz.thread_probe_figure(probe, label=f"{label}, {rb.load_label()}")
threads = THREADS or rb.steadiest_threads(probe)
display(Markdown(explain.threads_markdown(probe, cpus, os.getloadavg()[0], threads, asked=bool(THREADS))))

# %% [markdown]
# ## 1. What "in place" means, physically
# Below, one LoRA tensor of the engine (`lora_B` of the first layer's `q_proj`) is looked at across a
# refresh: the address of the memory that holds its values (its storage's pointer) before and after,
# and the values themselves. Between the two refreshes the trainer's weights change as an optimizer
# step would change them. A handle on the engine's tensor is kept across the refresh, so its old
# memory stays alive and a new tensor cannot land at the old address by chance. The tensors are the
# `hf` engine's (PEFT's parameters in this process); with `ENGINE = "sglang"` this cell starts an
# `hf` engine on the CPU for the purpose, since SGLang's LoRA pool lives in its scheduler process.

# %%
if engine.name == "hf":
    storage_engine, storage_model = engine, trainer_model
else:   # the same model and rank, in an hf engine on the CPU: the tensors this process can look at
    hf_cfg = Config.load(None, ["engine.backend=hf", "engine.hf.device=cpu", f"model.name_or_path={MODEL}",
                                "warmstart.steps=0", f"lora.r={RANK}"])
    storage_engine = start_engine(hf_cfg, model_path)
    storage_model = rb.adapter_model(model_path, RANK, dtype=hf_cfg.model.dtype)
storage = [explain.storage_across_refresh(storage_engine, storage_model, mode) for mode in ("inplace", "tensor")]
display(explain.storage_table(storage))
display(Markdown(explain.storage_markdown(storage)))

# %% [markdown]
# That is the difference the timings below measure. `inplace` copies new values into memory the
# engine already holds; nothing is allocated, named or wrapped again. `tensor` (and `file`, which
# reads the same tensors from a directory) unloads the adapter and loads a new one: fresh memory for
# every LoRA tensor, and on the `hf` engine PEFT wrapping the model's linear layers again. On SGLang
# the in-place write goes into the adapter's slot of the GPU LoRA pool, which keeps its addresses
# (the writer refuses a slot that moved), and the adapter keeps its name, so the engine flushes its
# prefix cache: KV computed with the old values must not be reused.

# %% [markdown]
# ## 2. Which mode is fastest end to end?
# Each mode refreshes the same rank-`RANK` adapter `REPEATS` times (merged last: it overwrites the
# engine's base weights). Left, end to end: each refresh call plus the first request after it (one
# prompt, one token, with the new adapter), every repeat a point, fastest median on top, each mode's
# floor as a white diamond, on a log axis so that the floor shows. The floor is the mode's bytes moved
# once at the fastest copy measured above: on a CPU a copy that fits in its caches runs several times
# faster than one that streams from memory, so the fastest size gives a floor no refresh can beat.
# Right: the median call split into its parts, then the median first request, on a linear axis so
# that the parts' lengths compare.
#
# **Predict first.** Which mode will be fastest end to end on this machine? On a GPU with SGLang the
# recorded answer is in section 5; this is a CPU (or whatever `ENGINE` runs on), and the engine
# runs in this process. Write `"file"`, `"tensor"`, `"inplace"` or `"merged"` into `my_prediction`.

# %%
my_prediction = None   # the mode you expect to be fastest here

# %%
with WaitProgress("refresh modes") as progress:
    rows = rb.measure_many(engine, [(trainer_model, mode, BUCKET_MB) for mode in rb.MODES], REPEATS,
                           progress.counting(len(rb.MODES)), threads)
modes_fig = viz.refresh_modes_figure(rows, bandwidth, label=f"{label}: LoRA r={RANK}, {BUCKET_MB:g} MB buckets, "
                                                            f"{REPEATS} repeats, {threads} thread(s), {rb.load_label()}")

# %%
explain.fit_table(pd.DataFrame([{
    "mode": r["mode"], "MB moved": r["bytes"] / 2**20, "end to end ms (median)": 1e3 * r["end_to_end_s"],
    "IQR ms": "–".join(viz.ms_text(q) for q in viz.quartiles(viz.end_to_end_ms(r))[::2]),
    "call ms": 1e3 * r["total_s"], "first request ms": 1e3 * r["first_request_s"],
    "floor ms": 1e3 * rb.floor_seconds(r["bytes"], bandwidth),
    "× floor": r["total_s"] / rb.floor_seconds(r["bytes"], bandwidth)} for r in rows]).set_index("mode"),
    {"MB moved": "{:.3g}", "end to end ms (median)": viz.ms_text, "call ms": viz.ms_text,
     "first request ms": viz.ms_text, "floor ms": "{:.2g}", "× floor": "{:,.0f}"})

# %%
display(Markdown(explain.mode_prediction_note(my_prediction, rows)))
display(Markdown(explain.modes_markdown(rows, bandwidth)))

# %% [markdown]
# What each mode does, which is what its parts measure:
# - `file` and `tensor` end the same way, with an unload and a load: the engine builds the adapter
#   anew every step (on the `hf` engine: PEFT wrapping the model's linear layers again). `file` also
#   writes a directory and the engine reads it back.
# - `inplace` skips both: the engine keeps the adapter it loaded first and only the values change
#   (section 1).
# - `merged` moves the full weights of every adapted layer, not only the adapter, so its bytes grow
#   with the model, not with the rank; afterwards the engine has no base model left (it serves
#   W + ΔW as its base, and decodes without LoRA kernels).
# - `× floor` says how far each call is from moving its bytes once; what is above the floor is
#   software (Python calls, per-tensor work, the engine's bookkeeping), not bytes.
#
# The order above is this run's. Where two modes' points overlap, their order is noise; on a busy
# machine even two modes whose points are apart can trade places in the next run, when the load
# changes while one of them is measured. Section 4 measures every mode again at each rank in
# `RANKS` and states only the order that holds at all of them: that is the one to expect again.

# %% [markdown]
# ## 3. How does the bucket size change a merged push?
# A merged refresh pushes the weights in buckets of at most `bucket_mb` MB (whole tensors, sorted by
# name; the cache is flushed once, after the last). Each bucket is one engine call. The bucket sizes
# are chosen from the model's own tensor sizes, so that each gives a different number of pushes, from
# one tensor per push to one push for everything. Left: the push count for every bucket size, as the
# refresher's packing gives it, with the sizes measured. Right: the push part of each merged refresh
# (the part the bucket size changes) against its pushes, every repeat, with a straight line through
# the medians and the floor (the weights moved once).

# %%
pushed = rb.merged_push_tensors(trainer_model)
buckets_mb = rb.distinct_push_buckets(pushed, MERGED_POINTS)
with WaitProgress("bucket sizes") as progress:
    merged = rb.measure_many(engine, [(trainer_model, "merged", mb) for mb in buckets_mb], REPEATS,
                             progress.counting(len(buckets_mb)), threads)
fig = viz.merged_buckets_figure(merged, rb.push_curve(pushed), bandwidth,
                                label=f"{label}: {merged[0]['bytes'] / 2**20:.3g} MB of weights, {REPEATS} repeats, "
                                      f"{threads} thread(s), {rb.load_label()}")
display(Markdown(explain.buckets_markdown(merged)))

# %% [markdown]
# The bytes are the same at every bucket size; what changes is the number of engine calls. Where the
# medians lie on a line, its slope is what one call costs (on the `hf` engine: a walk over the
# model's parameter names and a checked copy per tensor; on SGLang: a request round trip and
# `load_weights` over the bucket) and its intercept what the push costs however many calls carry it
# (the bytes themselves). The rest of the call, the snapshot and the merge, is the last line above.
# A larger bucket means fewer calls, each carrying more at once (`refresh.bucket_mb`'s help text:
# more peak memory).

# %% [markdown]
# ## 4. How does the cost change with the LoRA rank?
# The adapter's bytes grow in proportion to the rank: `r` rows of A and `r` columns of B per layer.
# Each rank in `RANKS` gets its own trainer-side adapter and every mode refreshes it `REPEATS` times.
# The figure is log-log, and the dashed line is a time in proportion to the adapter's bytes (slope
# 1, drawn from the fastest median at the smallest rank): a mode that climbs as steeply pays per byte,
# a flatter one pays mostly per call or per tensor, whatever the rank. The adapter's size is under
# each rank.

# %%
with WaitProgress("ranks × modes") as progress:
    by_rank = rb.rank_sweep(engine, model_path, RANKS, BUCKET_MB, REPEATS, dtype=cfg.model.dtype,
                            progress=progress.counting(len(RANKS) * len(rb.MODES)), threads=threads)
fig = viz.refresh_rank_figure(by_rank, label=f"{label}: {BUCKET_MB:g} MB buckets, {REPEATS} repeats, "
                                              f"{threads} thread(s), {rb.load_label()}")
display(Markdown(explain.rank_markdown(by_rank)))

# %% [markdown]
# Which parts can grow with the rank: the snapshot, the staging and the in-place write copy the
# adapter's bytes; the merge computes B·A for every adapted layer, whose cost grows with the rank,
# while the merged push moves the same full weights at every rank. The unload and load do per-tensor
# work over the same number of tensors at every rank, besides copying the bytes.

# %%
if SAVE_TO:
    print(rb.save_results(SAVE_TO, probe + rows + merged + by_rank, bandwidth, engine=label))
if storage_engine is not engine:
    storage_engine.close()
engine.close()

# %% [markdown]
# ## 5. On a GPU, with SGLang
# With `ENGINE = "sglang"` on a GPU, sections 0, 2, 3 and 4 measure SGLang itself. The repository
# records this lesson's section 2 from one H200 (`benchmarks/results/gpu/refresh_notebook02_sglang.json`,
# `docs/results.md`), with a random-init model of Qwen3-0.6B's shape in bf16 (the refresh cost
# depends on the shapes, not on the values) and `RANK = 32`. Side by side with this run (the GPU's
# end to end is its median call plus its median first request; the models and ranks differ, so
# compare the orders, not the milliseconds):

# %%
gpu = explain.gpu_mode_rows()
display(explain.fit_table(explain.cpu_gpu_table(rows, gpu), "{:.3g}"))
display(Markdown(explain.cpu_gpu_markdown(rows, gpu)))

# %% [markdown]
# In that recording most of `inplace`'s time was the first request (a full prefill: the prefix cache
# was flushed), SGLang's load was the largest part of the `file` and `tensor` calls, and a merged
# refresh's pushes were most of its time at every bucket size.
#
# ## Try it yourself
# Write down what you expect before you run each one.
# - Does `file` keep the engine's storage? Add a cell to section 1 with
#   `explain.storage_across_refresh(storage_engine, storage_model, "file")` and read `storage before`,
#   `storage after` and `old handle reads`. Section 1's explanation says what to expect.
# - Run the whole lesson again while another CPU-heavy program runs (in a terminal:
#   `python -c "while True: pass"`; stop it after). Which thread count does section 0 pick now? Then
#   set `THREADS` to the other count: compare the spread of the points in sections 2-4 with the
#   first run's.
# - Set `RANK = 64` and look at section 2: which parts grew, and which did not? Section 4's last
#   paragraph says which parts copy the adapter's bytes.
# - Set `MERGED_POINTS = 10`: do the medians of section 3 still sit on a line, and what does a push cost?

# %% [markdown]
# ## Self-check
# The collapsed cell below checks this lesson's own claims on this run: what the tables and the
# generated sentences say, and the bookkeeping behind them.

# %% tags=["self-check"] jupyter={"source_hidden": true}
measured = probe + rows + merged + by_rank
by_name = {r["mode"]: r for r in storage}
adapter_bytes = {r["rank"]: r["bytes"] for r in by_rank if r["mode"] == "tensor"}
stated = [m for group in explain.mode_groups(rows) for m in group]
explain.self_check({
    "in place: the engine's tensor kept its storage, and its values changed to the trainer's":
        by_name["inplace"]["storage before"] == by_name["inplace"]["storage after"]
        and by_name["inplace"]["values changed"] and by_name["inplace"]["engine = trainer"],
    "tensor: the engine's tensor is a new allocation with the trainer's values; the old one kept the old values":
        by_name["tensor"]["storage before"] != by_name["tensor"]["storage after"]
        and by_name["tensor"]["engine = trainer"] and by_name["tensor"]["old handle reads"] == "the old values",
    "section 2's sentence names the modes in the figure's order, fastest on top":
        stated == [t.get_text() for t in modes_fig.axes[0].get_yticklabels()],
    "the reveal names the fastest mode the figure shows on top":
        f"`{stated[0]}`" in explain.mode_prediction_note(None, rows).split("You wrote")[0],
    "section 5's table puts the modes in this run's order, the places 1 to 4":
        list(explain.cpu_gpu_table(rows, gpu).index) == [r["mode"] for r in sorted(rows, key=explain.refresh_costs.median_ms)]
        and list(explain.cpu_gpu_table(rows, gpu)["here: place"]) == list(range(1, len(rows) + 1)),
    "every bucket size gave a different push count, the one the packing computed":
        len({r["buckets"] for r in merged}) == len(merged)
        and all(r["buckets"] == rb.push_count(pushed, r["bucket_mb"]) for r in merged),
    "a merged push moves the same bytes at every bucket size, and at every rank":
        len({r["bytes"] for r in rows + merged + by_rank if r["mode"] == "merged"}) == 1,
    "the adapter's bytes grow in proportion to the rank":
        all(adapter_bytes[k] * RANKS[0] == adapter_bytes[RANKS[0]] * k for k in RANKS),
    "every point shows all its repeats": all(len(r["samples"]["end_to_end_s"]) == r["repeats"] for r in measured)
        and all(r["repeats"] == REPEATS for r in rows + merged + by_rank),
    f"sections 2-4 were timed with the {threads} thread(s) section 0 names, and the kernel's count is restored":
        all(r["threads"] == threads for r in rows + merged + by_rank) and torch.get_num_threads() == threads_before,
    "section 0's thread counts took turns: each was timed as often as the others, every repeat shown":
        {r["repeats"] for r in probe} == {REPEATS} and all(len(r["samples"]["end_to_end_s"]) == REPEATS for r in probe),
    "each refresh's parts add up to its total": all(abs(sum(r["parts"].values()) - r["total_s"]) < 1e-9
                                                   for r in measured),
    "no refresh beats the floor": all(r["total_s"] > rb.floor_seconds(r["bytes"], bandwidth) for r in measured),
    "section 3: every merged push part lies above the floor its figure draws":
        all(min(viz.part_ms(r, "push")) > 1e3 * rb.floor_seconds(r["bytes"], bandwidth) for r in merged),
})
