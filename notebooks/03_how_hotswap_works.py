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
# **What it shows.** What an adapter is (ΔW = (α/r)·B·A on one layer, as images), what it does
# to the model's predictions (base vs adapter-applied next-token probabilities, and the per-token
# log-prob difference along a sequence, from the engine), what a refresh does over time (its parts
# on a timeline), and three failure modes of real integrations, reproduced safely, each with the
# check that catches it:
# 1. a request without the adapter name silently runs the base model;
# 2. `'all-linear'` passed through `list()` becomes characters;
# 3. a stale adapter after a training step.
#
# **How long.** CPU (2 cores), defaults: under a minute (the tiny model is shared with notebook 01's
# cache; ~20 s to build it if that did not run). GPU (one H200, `ENGINE="sglang"`,
# `MODEL="Qwen/Qwen3-0.6B"`): not yet run from this notebook; expect a few minutes, mostly
# starting the engine.

# %%
# setup
# %load_ext autoreload
# %autoreload 2
import pandas as pd
import torch
from peft import LoraConfig

from lorabench import explain
from lorabench import refresh_bench as rb
from lorabench.adapters import AdapterError, plain_config
from lorabench.config import Config, ConfigError
from lorabench.engines import make_engine
from lorabench.engines.base import Sampling
from lorabench.grpo import GRPOTrainer
from lorabench.models import prompt_ids, resolve_model_path
from lorabench.refresh import make_refresher

# %% tags=["parameters"]
ENGINE = "hf"        # "hf" (CPU or GPU) | "sglang" (GPU)
MODEL = "tiny"       # "tiny" | "Qwen/Qwen3-0.6B"
STEPS = 3            # GRPO steps before looking inside, so the adapter is not zero
STALE_STEPS = 3      # steps of the stale-adapter control
LAYER = "model.layers.0.self_attn.q_proj"
# the same CI size as notebook 01 (so the warm-started tiny model is shared); [] = the demo's defaults
SIZE = ["warmstart.steps=40", "warmstart.batch_size=16", "warmstart.lr=1e-2",
        "warmstart.strict_format_fraction=0.5", "grpo.prompts_per_step=2", "grpo.group_size=8",
        "grpo.max_new_tokens=40", "grpo.lr=3e-3", "grpo.format_bonus=0.5", "data.eval_size=8"]
EXTRA = []

# %%
if ENGINE == "sglang":
    import nest_asyncio
    nest_asyncio.apply()
cfg = Config.load(None, [f"engine.backend={ENGINE}", f"model.name_or_path={MODEL}", "refresh.mode=tensor",
                         *SIZE, *EXTRA])
model_path = resolve_model_path(cfg)
engine = make_engine(cfg, model_path)
trainer = GRPOTrainer(cfg, model_path, engine)       # no run dir: nothing is written
tok, adapter = trainer.tokenizer, trainer.refresher.serving_adapter
trainer.run(STEPS)
pd.DataFrame(trainer.history)[["step", "reward/mean", "mismatch/max", "adapter/delta_norm"]]

# %% [markdown]
# ## 1. An adapter is a low-rank ΔW
# A LoRA layer keeps the base weight W frozen and learns two small matrices, A (r × in) and
# B (out × r). The layer computes `W·x + (α/r)·B·(A·x)`, i.e. it uses W + ΔW with
# ΔW = (α/r)·B·A, a matrix of rank at most r. PEFT starts B at zero, so a fresh adapter is the
# base model exactly; GRPO moved it in the steps above.

# %%
f = explain.lora_factors(trainer.model, LAYER)
fig = explain.plot_lora_factors(f)

# %% [markdown]
# Check: the layer's output is the base output plus ΔW applied to the input, and ΔW has rank ≤ r.

# %%
layer = trainer.model.get_submodule(f"base_model.model.{LAYER}")
x = torch.randn(3, f["W"].shape[1])
with torch.no_grad():
    y = layer(x.to(trainer.device)).float().cpu()
assert torch.allclose(y, x @ (f["W"] + f["delta"]).T, atol=1e-4), (y - x @ (f["W"] + f["delta"]).T).abs().max()
rank = torch.linalg.matrix_rank(f["delta"]).item()
print(f"rank(ΔW) = {rank} ≤ r = {f['A'].shape[0]}; scaling α/r = {f['scaling']}")
assert rank <= f["A"].shape[0]

# %% [markdown]
# ## 2. Base vs adapter-applied predictions
# Where the policy changes: the token after the worked solution, where the model chooses how to
# write its final answer (the strict reward pays only for `#### N`). Next-token probabilities from
# the trainer's model, adapter on and off:

# %%
problem = trainer.source.eval_set(1)[0]
reasoning = problem.answer.rsplit("####", 1)[0]          # the solution without its final line
prefix = prompt_ids(tok, problem.messages) + tok(reasoning, add_special_tokens=False)["input_ids"]
topk = explain.next_token_topk(trainer.model, tok, prefix, k=6)
ax = explain.plot_topk(topk)

# %% [markdown]
# The same through the engine: each token of the reference answer scored with the adapter's
# name and without it (the base model), as the difference of log-probs.

# %%
prompt = prompt_ids(tok, problem.messages)
sequence = prompt + tok(problem.answer, add_special_tokens=False)["input_ids"]
diff = explain.logprob_difference(engine, sequence, len(prompt), adapter)
ax = explain.plot_logprob_difference([tok.decode([t]) for t in sequence[len(prompt):]], diff)
assert diff.abs().max() > 0, "the adapter has no effect: is it loaded?"

# %% [markdown]
# ## 3. A refresh, part by part
# One refresh of this adapter by each method, on this engine, under a scratch name. `merged`
# writes W + ΔW into the engine's base weights, so afterwards the engine has no base model left;
# the cell puts the base weights back and checks that the served adapter is exact again.

# %%
timeline = [rb.measure_refresh(engine, trainer.model, mode, bucket_mb=1.0, repeats=1, adapter_name="timeline")
            for mode in ("file", "tensor", "merged")]
ax = explain.plot_refresh_timeline(timeline)
ax.set_title(f"One refresh, part by part ({rb.engine_label(engine)})")
explain.restore_base_weights(engine, trainer.model)
seqs, plens = explain.rollout_sequences(trainer, 2)
restored = explain.trainer_vs_engine(trainer, seqs, plens, adapter)
print("after restoring the base weights, trainer vs engine:", restored)

# %% [markdown]
# ## 4. Three failure modes, reproduced safely
# ### 4.1 A request without the adapter name silently runs the base model
# The engine serves many adapters and the base model side by side; each request names what it
# wants. Leave the name out and the request still succeeds, with the base model: no error, just
# rollouts from the wrong policy and a run that learns nothing.

# %%
greedy = Sampling(cfg.grpo.max_new_tokens, 0.0)
prompts = [prompt_ids(tok, p.messages) for p in trainer.source.eval_set(3)]
named = engine.generate(prompts, greedy, adapter=adapter)
unnamed = engine.generate(prompts, greedy, adapter=None)  # no error: the base model answers
pd.DataFrame({"with adapter name": tok.batch_decode([c.token_ids for c in named], skip_special_tokens=True),
              "without": tok.batch_decode([c.token_ids for c in unnamed], skip_special_tokens=True)})

# %% [markdown]
# **The check:** score the tokens a request produced with the trainer and compare log-probs
# (GRPO does this on every step's rollouts: `mismatch/mean`, `mismatch/max`). With the name the
# engine and the trainer agree to float noise; without it they differ by the adapter's effect.

# %%
with_name = explain.trainer_vs_engine(trainer, seqs, plens, adapter)
without_name = explain.trainer_vs_engine(trainer, seqs, plens, None)
print(f"trainer vs engine |Δ log-prob|  with the name: {with_name}\n"
      f"                              without the name: {without_name}")
if ENGINE == "hf":  # float32 on both sides; SGLang's bf16 kernels add ~1e-2 of noise
    assert with_name["max"] < 1e-4 and without_name["mean"] > 100 * with_name["mean"]

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
snapshot = trainer.snapshot()
refused = None
try:
    engine.load_adapter_tensors("naive", snapshot.tensors, {**snapshot.config, "target_modules": naive})
except AdapterError as err:
    refused = err
print("engine load refused:", refused)
assert refused is not None and "characters" in str(refused)
assert "naive" not in engine.loaded_adapters()
try:
    Config.load(None, [f"lora.target_modules={','.join(naive)}"])
    raise AssertionError("the config accepted a list of characters")
except ConfigError as err:
    print("config refused:", err)

# %% [markdown]
# ### 4.3 A stale adapter after a training step
# If the refresh is skipped (or fails silently), the engine keeps serving the old adapter while
# the trainer moves on: rollouts come from a policy the trainer no longer has. `refresh.mode=none`
# is exactly that, as a control: the first adapter is loaded, then never updated. Same seed, same
# engine, same problems as the run above.

# %%
stale_cfg = Config.from_dict({**cfg.to_dict(), "refresh": {**cfg.to_dict()["refresh"], "mode": "none"}})
stale = GRPOTrainer(stale_cfg, model_path, engine)
stale.run(STALE_STEPS)
n = min(STEPS, STALE_STEPS)
pd.DataFrame({"step": range(1, n + 1),
              "refreshed: mismatch/max": [r["mismatch/max"] for r in trainer.history[:n]],
              "stale: mismatch/max": [r["mismatch/max"] for r in stale.history[:n]],
              "stale: ‖ΔW‖ in the trainer": [r["adapter/delta_norm"] for r in stale.history[:n]]})

# %% [markdown]
# **The check:** the same trainer-vs-engine comparison. Step 1 agrees (nothing was trained yet);
# from step 2 on the engine is behind. One real refresh puts it back in step.

# %%
seqs, plens = explain.rollout_sequences(stale, 2)
before = explain.trainer_vs_engine(stale, seqs, plens, stale.refresher.serving_adapter)
make_refresher(cfg, engine).refresh(stale.model, stale.step_count)   # a tensor refresh of the same name
after = explain.trainer_vs_engine(stale, seqs, plens, stale.refresher.serving_adapter)
print(f"stale engine: {before}\nafter one refresh: {after}")
if ENGINE == "hf":
    assert before["mean"] > 100 * after["mean"] and after["max"] < 1e-4

# %% [markdown]
# | failure | what you see without a check | the check |
# |---|---|---|
# | request without the adapter name | nothing: the base model answers, the run does not learn | trainer-vs-engine log-prob mismatch on the rollouts (`mismatch/*`, every step); adapter-vs-base gap on a fixed probe (`probe/adapter_gap`) |
# | `list('all-linear')` | an adapter that adapts nothing, or an engine error far from the cause | `adapters.validate` before any engine call; config validation at start-up; `plain_config` keeps the string |
# | stale adapter | rollouts from an old policy; reward stalls | the same mismatch, which jumps after the first missed refresh |

# %%
stale.close()
trainer.close()
engine.close()
