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
# # Step through a GRPO run
#
# **What it shows.** GRPO with LoRA, one step at a time: each step samples completions from the
# rollout engine (which serves the current adapter by name), scores them, takes one optimizer step
# on the LoRA weights and hot-swaps the new adapter into the engine. The panel below has
# **Step / Run N / Stop** buttons and shows, live:
# the reward curve, the last group's completions with their rewards and advantages, the refresh of
# the step (its parts and total), the trainer-vs-engine log-prob mismatch (~1e-6 when the refresh
# is exact) and the adapter's weight norm ‖ΔW‖.
#
# The run is written to a run directory in the CLI's format (`config.json`, `metrics.jsonl`,
# `sync.jsonl`, `rollouts.jsonl`, `evals.jsonl`, checkpoint), so `lorabench resume` continues it
# (last cell).
#
# **How long.** CPU (2 cores), defaults: about 1 minute: building and warm-starting the tiny model
# (~20 s, once; cached in `~/.cache/lorabench`), then ~1-2 s per step.
# GPU (one H200), `ENGINE="sglang"`, `MODEL="Qwen/Qwen3-0.6B"`: not yet run from this notebook; the
# committed GPU results suggest about a minute to start the engine, then 1.5-4 s per step at the
# demo's batch size (benchmarks/results/gpu/qwen3_06b_shape.json).

# %%
# setup
# %load_ext autoreload
# %autoreload 2
import time
from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display
from tqdm.auto import tqdm  # noqa: F401  (progress bars render as widgets)

from lorabench.config import Config
from lorabench.runlog import read_jsonl
from lorabench.session import RunSession
from lorabench.widgets import StepPanel

# %% tags=["parameters"]
ENGINE = "hf"          # "hf": transformers + PEFT, CPU or GPU | "sglang": in-process sglang.Engine (GPU)
MODEL = "tiny"         # "tiny": built offline (~2.5M params) | "Qwen/Qwen3-0.6B" (from the hub)
DATA = "synthetic"     # "synthetic": seeded GSM8K-style problems | "hub": openai/gsm8k
STEPS = 3              # GRPO steps run by this notebook (click Step for more)
RUN_ROOT = "../runs"   # run directories go here (git-ignored)
# CI size: a short warm-start that mostly ends answers without '#### N', small steps, and a bonus
# for the '#### N' format so even this barely trained model gets a learning signal.
# [] = the CLI demo's defaults (300 warm-start steps, 8 prompts x 16 completions: ~10 min on a CPU).
SIZE = ["warmstart.steps=40", "warmstart.batch_size=16", "warmstart.lr=1e-2",
        "warmstart.strict_format_fraction=0.5", "grpo.prompts_per_step=2", "grpo.group_size=8",
        "grpo.max_new_tokens=40", "grpo.lr=3e-3", "grpo.format_bonus=0.5", "data.eval_size=8"]
EXTRA = []             # any other section.field=value, e.g. "refresh.mode=file", "engine.attention_backend=triton"

# %%
if ENGINE == "sglang":
    import nest_asyncio
    nest_asyncio.apply()  # sglang.Engine runs its own event loop inside the kernel's

run_name = f"step-through-{time.strftime('%Y%m%d-%H%M%S')}"
cfg = Config.load(None, [f"engine.backend={ENGINE}", f"model.name_or_path={MODEL}", f"data.source={DATA}",
                         f"grpo.steps={STEPS}", f"run.out_dir={Path(RUN_ROOT).resolve()}",
                         f"run.name={run_name}", *SIZE, *EXTRA])
cfg.grpo, cfg.refresh

# %% [markdown]
# Open the run: model (built and warm-started on first use), engine, trainer, and a held-out
# evaluation before the first step, exactly as `lorabench run` does.

# %%
session = RunSession.open(cfg, Path(RUN_ROOT).resolve() / run_name)
session.run_dir

# %% [markdown]
# ## The panel
# **Step** runs one GRPO step, **Run N** runs N, **Stop** stops after the current step. Steps run
# in a background thread: the kernel stays free, and a second click while a run is going is
# refused. Mismatch is `|trainer log-prob − engine log-prob|` on the sampled tokens, computed by
# the trainer before its update: if the engine served a stale adapter or the base model, it jumps
# from ~1e-6 to 1e-2 or more.

# %%
panel = StepPanel(session.trainer)
panel

# %% [markdown]
# The same as clicking **Run N** with N = `STEPS` (this cell waits for the run, so that the
# cells below see it; clicking the button would not block).

# %%
panel.start(STEPS)
panel.wait()
pd.DataFrame(session.metrics())[["step", "reward/mean", "reward/strict_format", "mismatch/max",
                                 "adapter/delta_norm", "refresh/total_s", "time/step_s"]]

# %% [markdown]
# The refresh of each step, from `sync.jsonl` (one row per bucket, one per refresh):

# %%
sync = pd.DataFrame(read_jsonl(session.run_dir / "sync.jsonl"))
sync[sync["row"] == "refresh"].dropna(axis=1, how="all")

# %% [markdown]
# ## Continue from the CLI
# Every step wrote a checkpoint; this command continues the run where the notebook left it:

# %%
display(Markdown(f"```bash\n{session.resume_command(extra_steps=3)}\n```"))

# %%
rows = read_jsonl(session.run_dir / "metrics.jsonl")
assert (session.run_dir / "config.json").is_file() and (session.run_dir / "checkpoint").is_dir()
assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
# float32 hf engine: ~1e-6; SGLang's bf16 kernels: up to ~0.25 (benchmarks/results/gpu/grpo_sglang.json)
limit = 1e-3 if ENGINE == "hf" else 0.5
assert all(r["mismatch/max"] < limit for r in rows), "the engine did not serve the trainer's adapter"
print(f"{session.run_dir}: metrics.jsonl has {len(rows)} rows, one per step")

# %% [markdown]
# From the repository root, with the run directory printed above
# (`runs/step-through-<date>-<time>` with the default `RUN_ROOT`):
#
# ```bash
# lorabench resume runs/step-through-<date>-<time> grpo.steps=6
# ```
#
# `grpo.steps` is the total to reach; the resumed run appends steps 4-6 to the same files.
