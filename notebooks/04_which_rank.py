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
# # Which LoRA rank does RL need?
#
# **What it shows.** Four LoRA policies of different rank (1, 4, 16 and 64) trained side by side by
# GRPO in one run: one rollout engine serves all four adapters and gets every policy's prompts of a
# step as one batch, and the trainer keeps one frozen base model with four adapters on it. Each
# policy has its own optimizer, refresh and run directory, and sees the same problems with the same
# sampling seeds, so rank is the only difference. Then the curves are read: does a rank-1 adapter
# learn what a rank-64 one does? "LoRA Without Regret" (Thinking Machines, 2025) reports that for
# policy-gradient RL it does, because RL feeds the model very few bits per episode.
#
# **How long.** On a CPU (2 cores, `ENGINE = "hf"`, these defaults, the tiny model cached): **2-8 minutes**,
# most of it the four policies' 16 steps. The first time, the tiny model is built and warm-started into
# `~/.cache/lorabench`, where the other notebooks and `lorabench demo` find it too. On a GPU (one H200,
# `ENGINE = "sglang"`, the tiny model, Run All in a fresh kernel with SGLang in it): **70-124 s**. Measured
# runs: docs/results.md, section 9.

# %%
# setup
# %load_ext autoreload
# %autoreload 2
import json
import time
from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display

from lorabench import explain
from lorabench.session import Config, GroupSession
from lorabench.viz import rank_sweep_figure
from lorabench.widgets import GroupPanel, SessionCloser, WaitProgress, setup_notebook, sglang_in_notebook

setup_notebook()

# %% tags=["parameters"]
ENGINE = "hf"          # "hf": transformers + PEFT, CPU or GPU | "sglang": in-process sglang.Engine (GPU)
MODEL = "tiny"         # "tiny": built offline and warm-started (cached) | "Qwen/Qwen3-0.6B" or a local model dir
RANKS = [1, 4, 16, 64]  # one policy per rank
STEPS = 16             # GRPO steps of every policy
LR = 0.003             # the learning rate of every policy
RUN_ROOT = "../runs"   # the group's directory goes here (git-ignored)
# more config overrides for all policies, e.g. ["grpo.group_size=16"]
OVERRIDES = []

# %% [markdown]
# ## The experiment
# One config names the policies and what differs between them (`policies`, a list: a name and the
# fields that policy sets for itself; `lorabench run --help-config` lists which fields a policy may
# own). Everything else is shared: the problems, the sampling, the learning rate and `lora.alpha`.
# With alpha fixed, the update ΔW = (α/r)·B·A is scaled up as the rank goes down, which is how
# LoRA Without Regret compares ranks at one learning rate.

# %%
if ENGINE == "sglang":   # its progress bars go to a log file, not here
    OVERRIDES = [*sglang_in_notebook(), *OVERRIDES]
policies = [{"name": f"r{r}", "lora": {"r": r}} for r in RANKS]
group_dir = Path(RUN_ROOT).resolve() / f"ranks-{time.strftime('%Y%m%d-%H%M%S')}"
cfg = Config.load(None, [f"policies={json.dumps(policies)}", f"engine.backend={ENGINE}", f"model.name_or_path={MODEL}",
                         f"grpo.steps={STEPS}", f"grpo.lr={LR}", *OVERRIDES])
g = cfg.grpo
display(Markdown(f"{len(RANKS)} policies (ranks {', '.join(map(str, RANKS))}), each {g.prompts_per_step} problems × "
                 f"{g.group_size} completions per step, the same for all; α {cfg.lora.alpha}, learning rate {g.lr:g}; "
                 f"refresh by `{cfg.refresh.mode}`; engine `{ENGINE}`."))

# %% [markdown]
# ## Open the group
# `GroupSession.open` does what `lorabench run` does with a `policies` list: checks, builds the model,
# makes the group's directory (`group.json` and one ordinary run directory per policy, each
# resumable alone), starts one engine with room for every adapter, puts the four adapters on one
# base model in the trainer and scores held-out problems for each before the first step.

# %%
with WaitProgress("opening the group") as progress:
    progress("model, engine, four policies, held-out evaluations")
    session = GroupSession.open(cfg, group_dir)
sizes = {name: t.policy.layout.numel for name, t in session.trainer.trainers.items()}
display(pd.DataFrame([{"policy": name, "rank": t.policy.lora_layers.config["r"], "LoRA parameters": sizes[name],
                       "held-out strict before (greedy)": session.before[name][1]["strict"]}
                      for name, t in session.trainer.trainers.items()]).set_index("policy"))

# %% [markdown]
# ## Train them side by side
# **Step** takes one GRPO step of every policy: one engine batch with all their prompts (each
# prompt names its policy's adapter), then every policy's update, then each one's refresh. The table under the
# buttons checks what a policy alone would: every policy's rollouts came from its own adapter at its
# trainer's version. The cell below runs `STEPS` steps; the panel stays live afterwards.

# %% [markdown]
# **Predict first.** Which policy will be best on held-out problems after `STEPS` steps: the
# smallest rank, the largest, or one between? Write its name (`"r1"`, `"r4"`, ...) into
# `my_prediction` before the run; the verdict below checks it.

# %%
my_prediction = None   # e.g. "r1"

# %%
panel = GroupPanel(session.trainer)
display(panel)

# %%
panel.start(STEPS - session.trainer.step_count)
last = panel.wait()   # {policy: its last StepRecord}

# %% [markdown]
# ## Read the curves
# The training reward is noisy (each step's is a mean over a few dozen completions), so the
# comparison that counts is the held-out one after training, with its standard error: a difference
# smaller than two standard errors is not a difference at this sample size.

# %%
with WaitProgress("held-out evaluation of every policy") as progress:
    after = session.trainer.evaluate(greedy=True)
histories = {name: list(t.history) for name, t in session.trainer.trainers.items()}
before = {name: evals[1] for name, evals in session.before.items()}   # greedy, before step 1
verdict, tied = explain.rank_verdict(after, before)
display(Markdown(verdict))
display(Markdown(explain.prediction_sentence(my_prediction, after, tied)))
fig = rank_sweep_figure(histories, after)

# %% [markdown]
# ## How far each policy moved
# The panel's ‖ΔW‖ plot, as numbers, with the GRPO quantities behind each update (means over the
# policy's steps): the gradient's norm, the share of groups whose rewards differed (the others have
# all-zero advantages and add nothing), and the loss (~0 inside a step: ρ = 1, and a group's
# advantages sum to 0).

# %%
ranks = {name: t.policy.lora_layers.config["r"] for name, t in session.trainer.trainers.items()}
display(explain.update_table(histories, ranks, cfg.lora.alpha))
update_text = explain.update_sentence(histories, ranks, cfg.lora.alpha, tied, g.lr)
display(Markdown(update_text))

# %% [markdown]
# **What to take from it.** This is one seed of a small model on a short run: it says whether rank
# separated these policies here, not in general; the two paragraphs above say what it did here.
# LoRA Without Regret's claim is about capacity (an RL run stores little information per episode,
# so a small rank has room enough), measured at each rank's best learning rate; a supervised run on
# a large dataset is where small ranks fall behind.
#
# **Try it.** Put a learning-rate sweep in the same way: one rank, `policies` differing in
# `grpo.lr` (e.g. 1e-3, 3e-3, 1e-2). Predict first: will the best learning rate for rank 64 be
# higher or lower than for rank 1, given the α/r column above? Or continue this group from a shell (the command appears
# after you close the session below).

# %% [markdown]
# ## Close the session
# The panel stays live until you close the session: the button waits for a running step, releases
# the engine and the run directories' locks, and shows the command that continues every policy.

# %%
closer = SessionCloser(panel, session, extra_steps=STEPS)
display(closer)

# %% tags=["self-check"] jupyter={"source_hidden": true}
# self-check: what the text above relies on
rows = {name: list(t.history) for name, t in session.trainer.trainers.items()}
checks = {
    "every policy took every step, each rollout served by its own adapter at its trainer's version": all(
        [r["adapter/served_version"] for r in policy_rows] == list(range(len(policy_rows)))
        and len(policy_rows) == STEPS for policy_rows in rows.values()),
    "one engine served all the policies": all(t.engine is session.engine for t in session.trainer.trainers.values()),
    "a LoRA policy's parameter count grows with its rank": [sizes[f"r{r}"] for r in RANKS] == sorted(sizes.values()),
    "each policy's run dir is an ordinary run dir": all(
        (group_dir / name / "config.json").is_file() for name in session.trainer.trainers),
    "the verdict names the policies the numbers tie": tied == explain.rank_verdict(after, before)[1],
    "the update sentence quotes each policy's last ‖ΔW‖ and α/r": all(
        f"{name} {policy_rows[-1]['adapter/delta_norm']:.3g}" in update_text
        and f"{cfg.lora.alpha / ranks[name]:g}" in update_text for name, policy_rows in rows.items()),
    "the update sentence's trend word follows the ‖ΔW‖ numbers": (
        "falls as the rank grows" in update_text) == all(
        rows[a][-1]["adapter/delta_norm"] > rows[b][-1]["adapter/delta_norm"]
        for a, b in zip(sorted(rows, key=ranks.get), sorted(rows, key=ranks.get)[1:])),
    "the reveal names the best held-out policy": f"**{max(after, key=lambda n: after[n]['strict'])}**" in
        explain.prediction_sentence(None, after, tied),
}
explain.self_check(checks)
