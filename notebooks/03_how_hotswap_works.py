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
# # How LoRA hot-swap works
#
# **What it shows.** A short GRPO run on the model of `lorabench demo` (30 steps of 8 problems ×
# 8 completions), then a look inside: what an adapter is (ΔW = (α/r)·B·A on one layer), what it
# changed in the model's predictions (next-token probabilities with and without it, and its
# effect on each token of a reference answer, scored by the engine), what a refresh does over time
# (its parts on a timeline), and three failure modes of real integrations, reproduced safely, each
# with the check that catches it:
# 1. a request without the adapter's name silently runs the base model;
# 2. `'all-linear'` passed through `list()` becomes characters;
# 3. a stale adapter after a training step.
#
# **How long.** On a CPU (2 cores), these defaults: about 1 minute (51-72 s measured in three runs
# of Run All in a fresh kernel) once the tiny model is cached, as after notebook 01 or `lorabench
# demo`; about 3 minutes (166 s) the first time, which builds the model and warm-starts it.
# On a GPU (one H200, `ENGINE = "sglang"`, Run All in a fresh Jupyter kernel, the tiny model cached):
# 1-1.5 minutes (58 and 82 s measured; starting the engine takes about 35 s of it).

# %%
# setup
# %load_ext autoreload
# %autoreload 2
import dataclasses
import statistics

import pandas as pd
from IPython.display import Markdown, display
from peft import LoraConfig

from lorabench import explain
from lorabench import refresh_bench as rb
from lorabench.adapters import AdapterError, plain_config
from lorabench.data import prompt_ids
from lorabench.refresh import make_refresher
from lorabench.session import Config, ConfigError, build_trainer, resolve_model, start_engine
from lorabench.widgets import setup_notebook, sglang_in_notebook

setup_notebook()

# %% tags=["parameters"]
ENGINE = "hf"        # "hf": transformers + PEFT, CPU or GPU | "sglang": in-process sglang.Engine (GPU)
MODEL = "tiny"       # "tiny": built offline and warm-started (cached) | "Qwen/Qwen3-0.6B" or a local model dir
STEPS = 30           # GRPO steps before looking inside (the demo's)
STALE_STEPS = 3      # steps of the stale-adapter control (section 4.3)
LAYER = "model.layers.0.self_attn.q_proj"   # the layer section 1 looks into
# more config overrides, e.g. ["grpo.group_size=16"]
OVERRIDES = []

# %%
if ENGINE == "sglang":   # its progress bars go to a log file, not here
    OVERRIDES = [*sglang_in_notebook(), *OVERRIDES]
cfg = Config.load(None, [f"engine.backend={ENGINE}", f"model.name_or_path={MODEL}", "refresh.mode=tensor",
                         *OVERRIDES])
model_path = resolve_model(cfg)
engine = start_engine(cfg, model_path)
trainer = build_trainer(cfg, model_path, engine)   # no run directory: nothing is written
adapter, tok = trainer.refresher.serving_adapter, trainer.tokenizer
trainer.run(STEPS, progress=False)
first, last = trainer.history[:5], trainer.history[-5:]
print(f"{STEPS} GRPO steps: reward {statistics.mean(r['reward/mean'] for r in first):.2f} (first 5 steps) → "
      f"{statistics.mean(r['reward/mean'] for r in last):.2f} (last 5); answers ending '#### N' "
      f"{statistics.mean(r['reward/strict_format'] for r in first):.0%} → {statistics.mean(r['reward/strict_format'] for r in last):.0%}")

# %% [markdown]
# ## 1. An adapter is a low-rank ΔW
# A LoRA layer keeps the base weight W frozen and learns two small matrices, A (r × in) and
# B (out × r). It computes `W·x + (α/r)·B·(A·x)`: the base layer plus ΔW = (α/r)·B·A, a matrix of
# rank at most r. With the defaults r = `lora.r` = 16 and α = `lora.alpha` = 32: α/r = 2 scales B·A. PEFT
# starts B at zero, so a fresh adapter is exactly the base model; the GRPO steps above moved it.

# %%
f = explain.lora_factors(trainer.model, LAYER)
fig = explain.plot_lora_factors(f)

# %% [markdown]
# The same claims, measured on the layer itself (random inputs x):

# %%
pd.Series(explain.lora_layer_facts(trainer.model, f)).to_frame(LAYER)

# %% [markdown]
# ΔW is a small change: a few percent of W in norm, and of rank r at most. A's rows are the r
# directions the layer reads from its input; B's columns, the directions it writes.
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

# %% [markdown]
# How to read it. A bar is large only where the two models disagree about a token. Most tokens
# of the reasoning copy the question (names, the item: "eggs", "left") and are near-certain for
# both models: small bars. The largest bar is usually `####`: the warm-start taught other endings
# for 90% of its answers ("The answer is N.", "= N", the bare number), so the base model gives
# `####` little probability there, and the strict reward pays only for `#### N`. That is what GRPO
# learned first (the top-k plot above shows the same position). The number after `####` repeats
# the result of the reasoning, so both models agree on it again. The remaining bars are
# arithmetic: where the base model is unsure of a result (the number after "="), the update also
# moved that choice, and not always towards the right number. In 30 steps GRPO teaches the
# format, not arithmetic.

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
pd.DataFrame({"after the merged refresh": after_merge, "base weights restored": restored}).T.rename(
    columns=lambda c: f"|Δ log-prob| {c}")

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
pd.DataFrame({"with the name": with_name, "without": without_name}).T.rename(columns=lambda c: f"|Δ log-prob| {c}")

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
    engine.load_adapter_tensors("naive", dataclasses.replace(current, config={**current.config, "target_modules": naive}))
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
# is exactly that, as a control: the first adapter is loaded, then never updated. Same seed, same
# engine, same problems as the run above, for `STALE_STEPS` steps.

# %%
stale_cfg = Config.from_dict({**cfg.to_dict(), "refresh": {**cfg.to_dict()["refresh"], "mode": "none"}})
stale = build_trainer(stale_cfg, model_path, engine)
stale.run(STALE_STEPS, progress=False)
pd.DataFrame({"refreshed: mismatch p99": [r["mismatch/p99"] for r in trainer.history[:STALE_STEPS]],
              "stale: mismatch p99": [r["mismatch/p99"] for r in stale.history],
              "stale: ‖ΔW‖ in the trainer": [r["adapter/delta_norm"] for r in stale.history]},
             index=pd.Index(range(1, STALE_STEPS + 1), name="step"))

# %% [markdown]
# **The check:** the same trainer-vs-engine comparison. Step 1 agrees (it samples with the first
# adapter, which the engine has); from step 2 on the engine is behind. One real refresh puts it
# back in step.

# %%
stale_seqs, stale_plens = explain.rollout_sequences(stale, 2)
before_refresh = explain.trainer_vs_engine(stale, stale_seqs, stale_plens, stale.refresher.serving_adapter)
make_refresher("tensor", engine, stale.refresher.serving_adapter).refresh(stale.policy.adapter())
after_refresh = explain.trainer_vs_engine(stale, stale_seqs, stale_plens, stale.refresher.serving_adapter)
pd.DataFrame({"stale engine": before_refresh, "after one refresh": after_refresh}).T.rename(
    columns=lambda c: f"|Δ log-prob| {c}")

# %% [markdown]
# | failure | what you see without a check | the check |
# |---|---|---|
# | request without the adapter's name | nothing: the base model answers, the run does not learn | trainer-vs-engine log-prob mismatch on the rollouts (`mismatch/*`, every step); the adapter's effect on a fixed probe (`probe/adapter_gap`) |
# | `list('all-linear')` | an adapter that adapts nothing, or an engine error far from the cause | `adapters.validate` before any engine call; config validation at start-up; `plain_config` keeps the string |
# | stale adapter | rollouts from an old policy; reward stalls | the same mismatch, which jumps after the first missed refresh; the engine reports the version it served, and a step refuses rollouts from an older one |

# %%
stale.close()
trainer.close()
engine.close()

# %% [markdown]
# ## Self-check
# The collapsed cell below checks what the lesson showed, with robust statistics (means and
# 99th percentiles of |Δ log-prob|; a single token's maximum is a rounding tail in bf16).

# %% tags=["self-check"] jupyter={"source_hidden": true}
facts = explain.lora_layer_facts(trainer.model, f)
noise_limit = 1e-4 if ENGINE == "hf" else 0.05   # |Δ log-prob| mean: float32 ~1e-7, SGLang's bf16 ~3e-3
explain.self_check({
    "the layer computes W·x + ΔW·x": facts["max |layer(x) − (W + ΔW)·x|"] < 1e-3 * max(1.0, float(f["W"].abs().max())),
    "rank of ΔW ≤ r": facts["rank of ΔW"] <= facts["r"],
    "the adapter changes the engine's log-probs": float(diff.abs().max()) > 0,
    "merged refresh undone: trainer and engine agree again": restored["mean"] < noise_limit,
    "with the name, trainer and engine agree": with_name["mean"] < noise_limit,
    "without the name, they differ by the adapter's effect": without_name["mean"] > 5 * with_name["mean"],
    "a split target_modules is refused by the engine and by the config":
        "characters" in str(engine_refusal) and isinstance(config_refusal, ConfigError),
    "the stale engine is behind, one refresh fixes it": before_refresh["p99"] > 2 * after_refresh["p99"]
        and after_refresh["mean"] < noise_limit,
})
