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
# # How LoRA hot-swap works
#
# **What it shows.** The adapter of a short GRPO run on the model of `lorabench demo` (30 steps of 8
# problems × 8 completions), taken from the checkpoint notebook 01 or `lorabench demo` left in `../runs`
# (only read; trained here, with a progress bar, when there is none; the first output says which),
# and a look inside: what an adapter is (ΔW = (α/r)·B·A on one layer, beside W on one colour scale,
# and its singular values: rank r; then an exercise on another layer), what it changed in the
# model's predictions (next-token probabilities with and without it, and its effect on each token
# of a reference answer, scored by the engine), what a refresh does over time (its parts on a
# timeline), and three failure modes of real integrations, reproduced safely, each with the check
# that catches it:
# 1. a request without the adapter's name silently runs the base model;
# 2. `'all-linear'` passed through `list()` becomes characters;
# 3. a stale adapter after a training step: refreshed and stale runs from the same start, side by
#    side (reward and mismatch per step, then held-out), and one group's GRPO advantages and clipped
#    loss, which cannot tell who sampled the rollouts.
#
# **How long.** Run All on a 2-core CPU at these defaults (hf engine, 1 torch thread, the tiny model cached),
# longer the more of its cores other work keeps busy: **2-5 minutes** when `RUN_ROOT` holds notebook 01's or
# the demo's run dir, **3-10 minutes** when 30 GRPO steps are trained here first. The first time ever,
# building and warm-starting the tiny model comes first (a progress bar counts its steps; cached afterwards).
# On a GPU (one H200 or H100, `ENGINE = "sglang"`, reusing notebook 01's run dir): **60-95 s**, about 35 s of
# it starting the engine. The last code cell prints this Run All's own time and load average; measured runs:
# docs/results.md, section 9.

# %%
# setup
# %load_ext autoreload
# %autoreload 2
import dataclasses
import os
import time

import pandas as pd
import torch
from IPython.display import Markdown, display
from peft import LoraConfig

from lorabench import explain
from lorabench import refresh_bench as rb
from lorabench.adapters import AdapterError, plain_config
from lorabench.data import prompt_ids
from lorabench.session import Config, ConfigError, build_trainer, start_engine
from lorabench.session.reuse import dir_listing, find_trained_run
from lorabench.widgets import WaitProgress, setup_notebook, sglang_in_notebook

setup_notebook()
STARTED = time.perf_counter()   # the closing cell says how long this Run All took

# %% tags=["parameters"]
ENGINE = "hf"        # "hf": transformers + PEFT, CPU or GPU | "sglang": in-process sglang.Engine (GPU)
MODEL = "tiny"       # "tiny": built offline and warm-started (cached) | "Qwen/Qwen3-0.6B" or a local model dir
RUN_ROOT = "../runs"   # notebook 01 and `lorabench demo` (run from the repository root) write run dirs here
STEPS = 30           # GRPO steps trained here, only when RUN_ROOT holds no checkpoint of this experiment
COMPARE_STEPS = 12   # steps of each refreshed and each stale run (section 4.3)
SEEDS = 2            # seeds of that comparison: each adds two runs
THREADS = 1          # torch CPU threads: on 2 shared cores, 1 kept a step at ~3 s where 2 took 9-80 s
LAYER = "model.layers.0.self_attn.q_proj"   # the layer section 1 looks into
# more config overrides, e.g. ["grpo.group_size=16"]
OVERRIDES = []

# %%
if ENGINE == "sglang":   # its progress bars go to a log file, not here
    OVERRIDES = [*sglang_in_notebook(), *OVERRIDES]
torch.set_num_threads(THREADS)
LESSON = [f"engine.backend={ENGINE}", f"model.name_or_path={MODEL}", "refresh.mode=tensor", f"run.threads={THREADS}",
          *OVERRIDES]
cfg = Config.load(None, LESSON)
model_path, model_built, model_seconds = explain.resolve_model_shown(cfg.model, cfg.warmstart, cfg.run.seed)
with WaitProgress("starting the engine and the trainer", expected_s=35 if ENGINE == "sglang" else 5):
    engine = start_engine(cfg, model_path)
    trainer = build_trainer(cfg, model_path, engine, log=lambda *a: None)   # its run log writes nothing
adapter, tok = trainer.refresher.serving_adapter, trainer.tokenizer

# %% [markdown]
# ## The adapter to look into
# Notebook 01 and `lorabench demo` train this experiment and leave a run dir with a checkpoint after
# every step. The lesson takes the newest one under `RUN_ROOT` whose experiment is this one: every
# setting a continued run may not change (`lorabench resume` refuses them) equal, and the base model
# the one its checkpoint recorded. `lorabench.session.reuse` reads it with the readers `lorabench
# resume` uses, but only reads: `config.json`, the checkpoint (weights only) and `metrics.jsonl`;
# nothing there is written, and no link in it is followed. With no such run dir it trains `STEPS`
# steps here.

# %%
found = find_trained_run(cfg, RUN_ROOT, model_path)   # (the newest run of this experiment or None, passed over)
run = found[0]
display(Markdown(explain.use_trained_run(trainer, found, RUN_ROOT, STEPS)))

# %% [markdown]
# ## 1. An adapter is a low-rank ΔW
# A LoRA layer keeps the base weight W frozen and learns two small matrices, A (r × in) and
# B (out × r). It computes `W·x + (α/r)·B·(A·x)`: the base layer plus ΔW = (α/r)·B·A, a matrix of
# rank at most r. With the defaults r = `lora.r` = 16 and α = `lora.alpha` = 32: α/r = 2 scales B·A. PEFT
# starts B at zero, so a fresh adapter is exactly the base model; the GRPO steps moved it. The two
# factors, each on its own colour scale:

# %%
f = explain.lora_factors(trainer.model, LAYER)
fig = explain.plot_lora_factors(f)

# %% [markdown]
# Their product ΔW beside the frozen W it is added to, both on W's colour scale: that is how large
# the change is. On that scale ΔW is nearly blank, so the third panel draws it again on its own
# scale, magnified by the factor in its title.

# %%
delta_fig = explain.plot_delta_w(f)

# %% [markdown]
# "Rank at most r" means ΔW has at most r directions. Its singular values say how many it has:
# W's, for comparison, decline gently over all of its directions.

# %%
spectrum = explain.delta_w_spectrum(f)
fig = explain.plot_singular_values(spectrum, LAYER)

# %%
display(Markdown(explain.cliff_sentence(spectrum)))

# %% [markdown]
# The same claims, measured on the layer itself (random inputs x):

# %%
explain.facts_frame(explain.lora_layer_facts(trainer.model, f), LAYER)

# %% [markdown]
# ΔW is a change to W of the size the table's ‖ΔW‖ / ‖W‖ gives, with at most r directions. A's rows
# are the r directions the layer reads from its input; B's columns, the directions it writes.
#
# **Exercise.** Every adapted layer has its own ΔW. Before you run the next cell, predict: in the
# MLP's `down_proj` of the last layer, will ΔW still have rank r, and will its ‖ΔW‖ / ‖W‖ be larger
# or smaller than here? Then try other layers (`print([n for n, _ in trainer.model.named_modules()
# if n.endswith("lora_A")])` lists them), or put `"lora.r=4"` in `OVERRIDES` and Run All: the
# cliff moves to index 4 (a different experiment, so the lesson trains its own adapter). Layer names
# run from `model.layers.0` to `model.layers.{L-1}` (L = `trainer.model.config.num_hidden_layers`),
# each with `self_attn.{q,k,v,o}_proj` and `mlp.{gate,up,down}_proj`.

# %%
OTHER_LAYER = f"model.layers.{trainer.model.config.num_hidden_layers - 1}.mlp.down_proj"   # change me
other = explain.lora_factors(trainer.model, OTHER_LAYER)
other_spectrum = explain.delta_w_spectrum(other)
print(f"{OTHER_LAYER}: ‖ΔW‖ / ‖W‖ = {float(other['delta'].norm() / other['W'].norm()):.2g} "
      f"(here {float(f['delta'].norm() / f['W'].norm()):.2g} in {LAYER})")
display(Markdown(explain.cliff_sentence(other_spectrum)))

# %% [markdown]
#
# ## 2. What the adapter changed in the predictions
# One held-out problem the run never trained on, and its reference answer:

# %%
problem = trainer.source.eval_set(1)[0]
reasoning = problem.answer.rsplit("####", 1)[0]     # the worked solution, without its final line
display(Markdown(f"**Question.** {problem.question}\n\n**Reference answer.**\n```\n{problem.answer}\n```"))

# %% [markdown]
# Give the model the question and the worked solution, everything but the final line, and ask
# for the next token. This is where the model chooses how to write its final answer, and the
# strict reward pays only for `#### N`. Next-token probabilities from the trainer's model, with
# the adapter and without it:

# %%
prompt = prompt_ids(tok, problem.messages)
prefix = prompt + tok(reasoning, add_special_tokens=False)["input_ids"]
topk = explain.next_token_topk(trainer.model, tok, prefix, k=6)
ax = explain.plot_topk(topk, title=f"Next token after the worked solution ({reasoning.strip().splitlines()[-1]!r})")

# %% [markdown]
# Now the engine: every token of the reference answer scored with the adapter's name and without
# it, as the difference of log-probs. Green: the adapter made the token more likely.

# %%
sequence = prompt + tok(problem.answer, add_special_tokens=False)["input_ids"]
diff = explain.logprob_difference(engine, sequence, len(prompt), adapter)
tokens = explain.token_labels(tok, sequence[len(prompt):])
ax = explain.plot_logprob_difference(tokens, diff)
largest = explain.top_effects(tokens, diff, k=3)
print("largest effects: " + ", ".join(f"{t!r} at position {i} ({d:+.2f} nats)" for i, t, d in largest))
print("'####' is " + ("" if any("####" in t for _, t, _ in largest) else "not ") + "among them in this run")

# %% [markdown]
# How to read it. A bar is large only where the two models disagree about a token. Most tokens
# of the reasoning copy the question (names, the item: "eggs", "left") and are near-certain for
# both models: small bars. Where `####` is among the largest bars (the lines above say whether it
# is in this run), that is the format the strict reward pays for: the warm-start taught other endings
# for 90% of its answers ("The answer is N.", "= N", the bare number), so the base model gives `####`
# little probability there, and the GRPO steps raised it. The top-k plot above shows the same
# position. The number after `####` repeats the result of the reasoning, so both models agree on it
# again. The remaining bars are arithmetic: where the base model is unsure of a result (the number
# after "="), the update also moved that choice, and not always towards the right number. A bar
# shows what changed, not whether it got better; notebook 01 measures held-out correctness.

# %% [markdown]
# ## 3. A refresh, part by part
# One refresh by each mode on this engine, under a scratch name, of an adapter the size of this
# one. `merged` writes W + ΔW into the engine's base weights, so the engine has no base model left
# afterwards; the next cell puts the base weights back and checks that the engine and the trainer
# agree again.

# %%
same_size = rb.adapter_model(model_path, cfg.lora.r, dtype=cfg.model.dtype, device=str(engine.device))
timeline = [rb.measure_refresh(engine, same_size, mode, bucket_mb=1.0, repeats=3, adapter_name="timeline")
            for mode in rb.MODES]   # the median of 3 refreshes per mode
ax = explain.plot_refresh_timeline(timeline, title=f"One refresh, part by part ({rb.engine_label(engine)})")

# %%
seqs, plens = explain.rollout_sequences(trainer, 2)
after_merge = explain.trainer_vs_engine(trainer, seqs, plens, adapter)
explain.restore_base_weights(engine, trainer.model)
restored = explain.trainer_vs_engine(trainer, seqs, plens, adapter)
explain.fit_table(pd.DataFrame({"after the merged refresh": after_merge, "base weights restored": restored}).T.rename(
    columns=lambda c: f"|Δ log-prob| {c}"), "{:.2e}")

# %% [markdown]
# ## 4. Three failure modes, reproduced safely
# ### 4.1 A request without the adapter's name silently runs the base model
# The engine serves many adapters and the base model side by side; each request names what it
# wants. Leave the name out and the request still succeeds, with the base model: no error, just
# rollouts from the wrong policy and a run that learns nothing.

# %%
problems = trainer.source.eval_set(3)
pd.DataFrame({"with the adapter's name": explain.greedy_completions(trainer, problems, adapter),
              "without a name": explain.greedy_completions(trainer, problems, None)}
             ).style.set_properties(**{"white-space": "pre-wrap", "text-align": "left"})

# %% [markdown]
# **The check:** score the tokens a request produced with the trainer and compare log-probs. GRPO
# does this on every step's rollouts (`mismatch/mean`, `mismatch/p99`). With the name, engine and
# trainer agree to rounding noise; without it they differ by the adapter's effect.

# %%
with_name = explain.trainer_vs_engine(trainer, seqs, plens, adapter)
without_name = explain.trainer_vs_engine(trainer, seqs, plens, None)
explain.fit_table(pd.DataFrame({"with the name": with_name, "without": without_name}).T.rename(
    columns=lambda c: f"|Δ log-prob| {c}"), "{:.2e}")

# %% [markdown]
# ### 4.2 `'all-linear'` passed through `list()` becomes characters
# `target_modules` may be a string (`'all-linear'`) or a list of module names. Code that turns
# every iterable into a list on its way to JSON splits the string into characters. PEFT would
# reject that locally, but the adapter config crosses a process boundary to the engine, where a
# list of one-letter "modules" adapts nothing or fails far from its cause.

# %%
lora_config = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, target_modules="all-linear")
naive = list(lora_config.target_modules)
print("list('all-linear') ->", naive)
print("plain_config keeps it a string ->", repr(plain_config(lora_config)["target_modules"]))

# %% [markdown]
# **The checks:** the adapter validator refuses a config whose target modules look like a split
# string before any engine sees it, and the run config refuses such a list at start-up.

# %%
current = trainer.policy.adapter()
engine_refusal = config_refusal = None   # each set below when refused
try:
    engine.load_adapter_tensors("naive", dataclasses.replace(current, config={**current.config,
                                                                            "target_modules": naive}))
except AdapterError as err:
    engine_refusal = err
    print("engine load refused:", err)
try:
    Config.load(None, [f"lora.target_modules={','.join(naive)}"])
except ConfigError as err:
    config_refusal = err
    print("config refused:", err)

# %% [markdown]
# ### 4.3 A stale adapter after a training step
# If the refresh is skipped (or fails silently), the engine keeps serving the old adapter while
# the trainer moves on: rollouts come from a policy the trainer no longer has. `refresh.mode=none`
# is exactly that, as a control: the first adapter is loaded, then never updated.
#
# What it does to learning: two runs of `COMPARE_STEPS` steps from the same start (the same base
# model, first adapter, problems and sampling seeds), one refreshed after every step and one stale,
# on this engine; for each of `SEEDS` seeds (`run.seed`: the problems, the sampling and the LoRA
# init; the base model stays the same). Then each trainer's adapter is scored on held-out problems,
# the stale one after one real refresh.
#
# **Predict first.** The stale trainer takes the same gradient steps, on rollouts of the first
# adapter. Once its own adapter is served, will its held-out reward be *lower* than the refreshed
# trainer's, *the same*, or *higher*? Write it into `my_prediction` before you run the cells.

# %%
my_prediction = None   # "lower", "the same" or "higher": the stale trainer's held-out reward against the refreshed one's

# %%
def arm_trainer(arm, seed):
    """This lesson's config with `seed` (run.seed); the stale arm never refreshes; each arm serves a
    name of its own; not compiled (a GPU's compile, paid at the first step, would not pay off in a short run)."""
    arm_cfg = Config.load(None, [*LESSON, f"run.seed={seed}", f"engine.adapter_name={arm}-run", "grpo.compile=off",
                                 *(["refresh.mode=none"] if arm == "stale" else [])])
    return build_trainer(arm_cfg, model_path, engine, tokenizer=tok, log=lambda *a: None)


comparison = explain.refreshed_vs_stale(arm_trainer, COMPARE_STEPS, range(SEEDS))
summary = explain.compare_summary(comparison)
fig = explain.plot_refreshed_vs_stale(comparison)

# %% [markdown]
# How to read it. Step 1 is the same in both runs: both sample with the first adapter. From step 2
# on the stale engine still serves that adapter while its trainer has moved on, and the mismatch
# (right) jumps from rounding noise to the size of the trainer's update. The reward (left) is the
# reward of the engine's rollouts, so it shows what the engine served. What these runs gave:

# %%
sentence = explain.compare_sentence(summary, COMPARE_STEPS)
display(Markdown(sentence))

# %% [markdown]
# The reward curves show what each engine served. What each trainer learned shows on held-out
# problems the runs never trained on, with its own adapter served (the stale trainer's after one real
# refresh), beside the first adapter that the stale engine kept serving:

# %%
held, held_text = explain.heldout_table(summary), explain.heldout_sentence(summary)
display(held)
display(Markdown(held_text))
harm_text, harm_verdict = explain.harm_sentence(summary, my_prediction)
display(Markdown(harm_text))

# %% [markdown]
# **The check:** the same trainer-vs-engine comparison, on each stale run's last state: the engine
# still serves the first adapter while the trainer is `COMPARE_STEPS` updates further. One real
# refresh puts it back in step.

# %%
pd.DataFrame({f"seed {seed}: engine at v{c['served_before']}, trainer at v{c['trainer_version']}": {
                  "|Δ log-prob| mean, stale engine": c["before"]["mean"],
                  "|Δ log-prob| mean, after one refresh": c["after"]["mean"],
                  "|Δ log-prob| p99, stale engine": c["before"]["p99"],
                  "|Δ log-prob| p99, after one refresh": c["after"]["p99"]}
              for seed, c in zip(comparison["seeds"], comparison["check"])}).transpose().style.format("{:.2e}")

# %% [markdown]
# ### Why the trainer does not notice: one group's GRPO loss
# What a step computes from one group of G completions of one prompt, with the package's own
# functions (`rollout.score`, `rollout.collate`, `loss.token_logprobs`, `loss.grpo_loss`):
# - each completion's reward r<sub>i</sub>, and its advantage A<sub>i</sub> = (r<sub>i</sub> − mean r) /
#   (std r + 10<sup>−4</sup>) within the group: above the group's mean pushes up, below pushes down, and a
#   group whose rewards are all equal has every A<sub>i</sub> = 0 and teaches nothing;
# - per token t, the ratio ρ = π<sub>θ</sub>(t) / π<sub>old</sub>(t) and the clipped objective
#   −min(ρ·A, clip(ρ, 1 − ε, 1 + ε)·A), averaged over each completion's tokens, then over the group.
#
# The first stale run's trainer (seed 0), on a held-out problem, while its engine still served the
# first adapter (before the refresh above), and the same problem and sampling seed right after it:

# %%
stale_group, fresh_group = comparison["check"][0]["group_before"], comparison["check"][0]["group_after"]
print(", ".join(f"{k} {v}" for k, v in stale_group["shapes"].items()), "(G completions; L tokens, padded)")
explain.group_table(stale_group)

# %%
display(explain.group_loss_table({"stale engine": stale_group, "after one refresh": fresh_group}))
display(Markdown(explain.group_loss_sentence(stale_group, fresh_group)))

# %% [markdown]
# | failure | what you see without a check | the check |
# |---|---|---|
# | request without the adapter's name | nothing: the base model answers, the run does not learn | trainer-vs-engine log-prob mismatch on the rollouts (`mismatch/*`, every step); the adapter's effect on a fixed probe (`probe/adapter_gap`) |
# | `list('all-linear')` | an adapter that adapts nothing, or an engine error far from the cause | `adapters.validate` before any engine call; config validation at start-up; `plain_config` keeps the string |
# | stale adapter | rollouts from an old policy: the reward shows the old policy | the same mismatch, which jumps after the first missed refresh; the engine reports the version it served, and a step refuses rollouts from an older one |

# %%
trainer.close()
engine.close()
print(f"This Run All took {time.perf_counter() - STARTED:.0f} s in this kernel ({ENGINE} engine, {THREADS} torch "
      f"thread{'s' if THREADS > 1 else ''}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
      f"{'the tiny model built first, ' + f'{model_seconds:.0f} s' if model_built else 'the model cached'}).")

# %% [markdown]
# ## Self-check
# The collapsed cell below checks what the lesson showed, with robust statistics (means and
# 99th percentiles of |Δ log-prob|; a single token's maximum is a rounding tail in bf16).

# %% tags=["self-check"] jupyter={"source_hidden": true}
facts = explain.lora_layer_facts(trainer.model, f)
noise_limit = 1e-4 if ENGINE == "hf" else 0.05   # |Δ log-prob| mean: float32 ~1e-7, SGLang's bf16 ~3e-3
k, r = summary["last"], stale_group["rewards"]
recomputed = {arm: sum(explain.last_mean(rows, last=k) for rows in comparison["rows"][arm]) / SEEDS
              for arm in explain.ARMS}
used = (f"the trainer holds the checkpoint's adapter (step {run.step}), and the run dir was only read",
        torch.equal(trainer.policy.adapter().buffer.cpu(), run.checkpoint["adapter_buffer"])
        and (run.in_use or dir_listing(run.dir) == run.listing)) if run else (
        f"no checkpoint to reuse: the adapter was trained here, {STEPS} steps", trainer.step_count == STEPS)
explain.self_check({
    "the layer computes W·x + ΔW·x":
        facts["max |layer(x) − (W + ΔW)·x|"] < 1e-3 * max(1.0, float(f["W"].abs().max())),
    "W and ΔW are drawn on one colour scale":
        delta_fig.axes[0].images[0].get_clim() == delta_fig.axes[1].images[0].get_clim(),
    f"ΔW's singular values after r are below {explain.RANK_TOL:g} of the first":
        spectrum["after_r_vs_first"] < explain.RANK_TOL,
    used[0]: used[1],
    "the adapter changes the engine's log-probs": float(diff.abs().max()) > 0,
    "merged refresh undone: trainer and engine agree again": restored["mean"] < noise_limit,
    "with the name, trainer and engine agree": with_name["mean"] < noise_limit,
    "without the name, they differ by the adapter's effect": without_name["mean"] > 5 * with_name["mean"],
    "a split target_modules is refused by the engine and by the config":
        "characters" in str(engine_refusal) and isinstance(config_refusal, ConfigError),
    "every refreshed step sampled from the adapter of the step before": all(
        r["adapter/served_version"] == r["adapter/version"] - 1
        for rows in comparison["rows"]["refreshed"] for r in rows),
    "the stale runs' engine served version 0 at every step": summary["stale_served"] == [0],
    "each stale engine is behind, and one refresh fixes it": all(
        c["before"]["p99"] > 2 * c["after"]["p99"] and c["after"]["mean"] < noise_limit for c in comparison["check"]),
    "the sentence under the curves quotes their means": all(f"**{v:.2f}**" in sentence for v in recomputed.values()),
    "the held-out sentence quotes its table": all(f"{v:.0%}" in held_text for v in held.data.to_numpy().ravel()),
    "where the harm shows: the sentence quotes the served rewards and the held-out shares it compares": all(
        f"{summary['mean'][a]:.2f}" in harm_text for a in explain.ARMS) and all(
        f"{summary['heldout'][a][k]:.0%}" in harm_text for a in explain.ARMS for k in explain.HELDOUT_MEASURES),
    "its served-reward claim holds: 'shows' only if the refreshed run's reward was higher in every seed":
        ("It shows in the served reward" in harm_text) == (summary["refreshed_higher"] == SEEDS),
    "its held-out claim holds: 'does not show' only if no held-out share of the stale trainer is lower": (
        "does not show**" in harm_text) == all(explain.direction(summary["heldout"]["refreshed"][k],
        summary["heldout"]["stale"][k], explain.share_se(summary["heldout"]["refreshed"][k],
        summary["heldout"]["stale"][k], summary["heldout_n"])) != "fell" for k in explain.HELDOUT_MEASURES),
    "the group's advantages are (r − mean r) / (std r + 1e-4), as the formula above says": torch.allclose(
        stale_group["advantages"], (r - r.mean()) / (r.std(unbiased=False) + 1e-4), atol=1e-5),
    "with π_old = its own log-probs, the trainer's ratio is 1 (no token outside 1 ± ε)":
        stale_group["own"]["clip_fraction"] == 0 == fresh_group["own"]["clip_fraction"],
    "against the policy that sampled them, the stale engine's tokens are further from ratio 1 than after a refresh":
        float((stale_group["ratio"] - 1).abs().max()) > float((fresh_group["ratio"] - 1).abs().max()),
})
