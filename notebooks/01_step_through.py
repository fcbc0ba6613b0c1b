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
# **What it shows.** GRPO with LoRA, one step at a time, on the model of `lorabench demo`: a tiny
# Qwen3-architecture model warm-started on GSM8K-style problems, which often gets the number right
# but mostly ends its answer with "The answer is N." instead of the `#### N` the reward asks for. Each
# step samples 8 completions for each of 8 fresh problems from the rollout engine, scores them,
# takes one optimizer step on the LoRA weights and hot-swaps the new adapter into the engine. A
# panel with **Step / Run N / Stop** shows it live: the reward, the refresh of each step, whether
# the engine serves the trainer's policy, and the last group's completions. Then: held-out reward
# before and after, the same problems answered before and after, and the command that continues
# the run from a shell.
#
# **How long.** On a CPU (2 cores), these defaults: about 1.5 minutes (85-99 s measured in two runs
# of Run All in a fresh kernel) once the tiny model is cached; about 4 minutes (244 s) the first
# time, which builds the model and warm-starts it (400 steps) into `~/.cache/lorabench` (or
# `$LORABENCH_CACHE`), where notebook 03 and `lorabench demo` find it too.
# On a GPU (one H200, `ENGINE = "sglang"`, Run All in a fresh Jupyter kernel): 1-1.5 minutes (63 s
# with the tiny model cached; 96 s with the model built and warm-started in the kernel), of which
# starting the engine takes about 30 s.

# %%
# setup
# %load_ext autoreload
# %autoreload 2
import statistics
import time
from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display
from tqdm.auto import tqdm  # noqa: F401  (progress bars render as widgets)

from lorabench import explain
from lorabench.runlog import read_jsonl
from lorabench.session import Config, RunSession
from lorabench.widgets import StepPanel, setup_notebook, sglang_in_notebook

setup_notebook()

# %% tags=["parameters"]
ENGINE = "hf"          # "hf": transformers + PEFT, CPU or GPU | "sglang": in-process sglang.Engine (GPU)
MODEL = "tiny"         # "tiny": built offline and warm-started (cached) | "Qwen/Qwen3-0.6B" or a local model dir
DATA = "synthetic"     # "synthetic": seeded GSM8K-style problems | "hub": openai/gsm8k
STEPS = 30             # GRPO steps run below (the demo's); Step and Run N add more
RUN_ROOT = "../runs"   # run directories go here (git-ignored)
# more config overrides, e.g. ["refresh.mode=file", "grpo.group_size=16"]
OVERRIDES = []

# %%
if ENGINE == "sglang":   # its progress bars go to a log file, not here
    OVERRIDES = [*sglang_in_notebook(), *OVERRIDES]

run_dir = Path(RUN_ROOT).resolve() / f"step-through-{time.strftime('%Y%m%d-%H%M%S')}"
cfg = Config.load(None, [f"engine.backend={ENGINE}", f"model.name_or_path={MODEL}", f"data.source={DATA}",
                         f"grpo.steps={STEPS}", f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}",
                         *OVERRIDES])
g = cfg.grpo
display(Markdown(f"{g.prompts_per_step} problems × {g.group_size} completions per step, up to {g.max_new_tokens} "
                 f"new tokens at temperature {g.temperature}; LoRA rank {cfg.lora.r}, α {cfg.lora.alpha}, learning "
                 f"rate {g.lr:g}; refresh by `{cfg.refresh.mode}`; engine `{ENGINE}`."))

# %% [markdown]
# ## Open the run
# `RunSession.open` does what `lorabench run` does: checks the config, data and model, builds and
# warm-starts the tiny model on first use (cached afterwards by its recipe), creates the run
# directory (`config.json`, then per step `metrics.jsonl`, `sync.jsonl`, `rollouts.jsonl` and a
# checkpoint), starts the engine with the trainer's adapter, and scores held-out problems before
# the first step.

# %%
session = RunSession.open(cfg, run_dir)
problems = session.trainer.source.eval_set(3)                       # shown again after the run
answers_before = explain.greedy_completions(session.trainer, problems)  # adapter v0: the warm-started model
sampled, greedy = session.before
print(f"held-out reward before GRPO: {sampled['strict']:.2f} sampled, {greedy['strict']:.2f} greedy "
      f"({greedy['n']} problems; {greedy['format']:.0%} of greedy answers end with '#### N')")

# %% [markdown]
# ## The panel
# **Step** runs one GRPO step, **Run N** runs N, **Stop** stops after the current step. Steps run
# in a background thread, so the kernel stays free; a second click while a run is going is refused.
#
# The line under the buttons follows the adapter's versions: step k samples with adapter
# v(k−1), trains it into v(k) and refreshes v(k) into the engine, so step k+1 samples from it.
# Then one line each for the three numbers to watch:
# - **reward**: 1 for a completion whose last `#### N` has the right number, else 0 (no partial
#   credit, no format bonus unless `grpo.format_bonus` is set);
# - **probe gap**: how far the adapter has moved the served model, measured by the engine on one
#   fixed held-out answer, with the adapter and without it;
# - **mismatch**: the trainer's and the engine's log-probs of the tokens just sampled. Far below
#   the probe gap means the engine served exactly the trainer's adapter; a stale or missing
#   adapter would put it near the probe gap.

# %%
panel = StepPanel(session.trainer)
display(panel)

# %% [markdown]
# The same as clicking **Run N** with N = `STEPS`; this cell waits for the run to finish, so the
# cells below see all of it (a click would not block).

# %%
panel.start(STEPS)
last = panel.wait()   # the last step's record (StepRecord: .metrics, .refresh, .samples)

# %% [markdown]
# ## What the run did
# One row per step from `metrics.jsonl` (the panel's plots, as numbers):

# %%
columns = {"step": "step", "adapter/served_version": "sampled with", "adapter/version": "trained to",
           "reward/mean": "reward", "reward/strict_format": "ends '#### N'", "probe/adapter_gap": "probe gap",
           "mismatch/mean": "mismatch mean", "mismatch/p99": "mismatch p99", "refresh/total_s": "refresh s",
           "time/step_s": "step s"}
pd.DataFrame(session.metrics())[list(columns)].rename(columns=columns).set_index("step")

# %% [markdown]
# Held-out problems the run never trained on, before the first step and now (the same scoring
# as `lorabench demo`; sampled at the training temperature, and greedy):

# %%
after = [session.trainer.evaluate(greedy=False), session.trainer.evaluate(greedy=True)]
session.runlog.set_evals(session.trainer.step_count, after)   # evals.jsonl, as the CLI writes it
evals = {"before GRPO": session.before, f"after {session.trainer.step_count} steps": after}
pd.DataFrame({name: [s["strict"], g["strict"], g["format"], g["flexible"]] for name, (s, g) in evals.items()},
             index=["reward, sampled", "reward, greedy", "greedy: ends with '#### N'",
                    "greedy: last number right, any format"]).round(2)

# %% [markdown]
# Three held-out problems answered greedily before the first step (adapter v0: LoRA starts at
# zero, so this is the warm-started model) and now:

# %%
pd.DataFrame({"question": [p.question for p in problems], "answer": [p.ground_truth for p in problems],
              "before GRPO": answers_before, "after": explain.greedy_completions(session.trainer, problems)}
             ).style.set_properties(**{"white-space": "pre-wrap", "text-align": "left"}).hide(axis="index")

# %% [markdown]
# What the run learned: the reward counts a completion only if it ends with `#### N` and N is
# right, and the warm-started model rarely wrote `####`. Compare the row "ends with `#### N`" with
# the last row, which ignores the format: if the right numbers did not become more frequent while
# the reward rose, the run learned the format, not the arithmetic. That is what 30 steps of this
# reward mostly teach. The right format with a wrong number still scores 0.
#
# ## Continue from the CLI
# While the session is open, this kernel holds the run directory's lock and any other writer,
# `lorabench resume` included, is refused (naming this kernel's PID). Closing the session releases
# the engine and the lock; the panel's buttons stop working and its views stay.

# %%
panel.end("session closed: the run continues with `lorabench resume` (below)")
session.close()
display(Markdown(f"```bash\n{session.resume_command(extra_steps=STEPS)}\n```"))

# %% [markdown]
# Run it from the repository root. `grpo.steps` is the total to reach: the resumed run appends
# its steps to the same files, from the last checkpoint (every step writes one).
#
# ## Self-check
# The collapsed cell below checks the run the lesson talked about, from its files: one row per
# step, every step sampled from the adapter of the step before, and a mismatch that is noise
# (the median over steps of each step's 99th percentile; a single token's maximum is a rounding
# tail in bf16 and is not used).

# %% tags=["self-check"] jupyter={"source_hidden": true}
rows = read_jsonl(run_dir / "metrics.jsonl")
p99_limit = 1e-3 if ENGINE == "hf" else 0.1   # nats: float32 ~1e-6; SGLang's bf16 kernels ~1e-2
explain.self_check({
    "one metrics row per step, in order": [r["step"] for r in rows] == list(range(1, len(rows) + 1)),
    "each step sampled from the adapter of the step before":
        all(r["adapter/served_version"] == r["adapter/version"] - 1 for r in rows),
    f"median per-step p99 mismatch < {p99_limit:g} nats": statistics.median(r["mismatch/p99"] for r in rows) < p99_limit,
    "config, checkpoint and held-out evaluations written": (run_dir / "config.json").is_file()
        and (run_dir / "checkpoint").is_dir() and len(read_jsonl(run_dir / "evals.jsonl")) == 4,
})
