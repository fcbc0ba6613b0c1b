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
# # Step through a GRPO run
#
# **What it shows.** GRPO with LoRA, one step at a time, on the model of `lorabench demo`: a tiny
# Qwen3-architecture model warm-started on GSM8K-style problems, trained to end most answers with
# "The answer is N." instead of the `#### N` the reward asks for (the first cells measure how often
# it does, and how often the number is right). Each
# step samples 8 completions for each of 8 fresh problems from the rollout engine, scores them,
# takes one optimizer step on the LoRA weights and hot-swaps the new adapter into the engine. First
# one step's computation by hand (advantages, ratio, clipped loss, with their shapes), then a panel
# with **Step / Run N / Stop** that repeats it live. Then what the run really learned (the format,
# the arithmetic, KL to the base model and entropy), a run you break yourself (no refresh), and the
# command that continues the run from a shell.
#
# **How long.** On a CPU (2 cores, `ENGINE = "hf"`, these defaults, the tiny model cached): Run All takes
# **6-10 minutes**, longer the more of its cores other work keeps busy. The first time, building and
# warm-starting the tiny model into `~/.cache/lorabench` (or `$LORABENCH_CACHE`, where notebook 03 and
# `lorabench demo` find it too) adds 2-11 minutes. The bars and the panel's line show the time left. On a GPU
# (one H200 or H100, `ENGINE = "sglang"`): **107-225 s**, about 30 s of it starting the engine when its caches
# are warm; a step takes well under a second. Measured runs: docs/results.md, section 9.

# %%
# setup
# %load_ext autoreload
# %autoreload 2
import time
from pathlib import Path

import pandas as pd
import torch
from IPython.display import Markdown, display
from tqdm.auto import tqdm  # noqa: F401  (progress bars render as widgets)

from lorabench import explain, loss, rollout
from lorabench.runlog import read_jsonl
from lorabench.session import Config, RunSession, build_trainer
from lorabench.viz import broken_refresh_figure, run_learned_figure
from lorabench.widgets import SessionCloser, StepPanel, WaitProgress, setup_notebook, sglang_in_notebook

setup_notebook()

# %% tags=["parameters"]
ENGINE = "hf"          # "hf": transformers + PEFT, CPU or GPU | "sglang": in-process sglang.Engine (GPU)
MODEL = "tiny"         # "tiny": built offline and warm-started (cached) | "Qwen/Qwen3-0.6B" or a local model dir
DATA = "synthetic"     # "synthetic": seeded GSM8K-style problems | "hub": openai/gsm8k
STEPS = 30             # GRPO steps run below (the demo's); Step and Run N add more
BREAK_STEPS = 20       # steps of the "break it yourself" run (at most STEPS)
EXERCISE_STEPS = 5     # steps the panel takes with the reward you write
RUN_ROOT = "../runs"   # run directories go here (git-ignored)
CLOSE_AT_END = False   # True: the last cell closes the session itself (for a run without a person, e.g. papermill)
# more config overrides, e.g. ["refresh.mode=file", "grpo.group_size=16"]
OVERRIDES = []

# %%
if ENGINE == "sglang":   # its progress bars go to a log file, not here
    OVERRIDES = [*sglang_in_notebook(), *OVERRIDES]

run_dir = Path(RUN_ROOT).resolve() / f"step-through-{time.strftime('%Y%m%d-%H%M%S')}"
settings = [f"engine.backend={ENGINE}", f"model.name_or_path={MODEL}", f"data.source={DATA}", f"grpo.steps={STEPS}",
            f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}",
            "grpo.kl_metric=true", *OVERRIDES]   # KL to the base beside the reward: one more forward per step
cfg = Config.load(None, settings)
g = cfg.grpo
display(Markdown(f"{g.prompts_per_step} problems × {g.group_size} completions per step, up to {g.max_new_tokens} "
                 f"new tokens at temperature {g.temperature}; LoRA rank {cfg.lora.r}, α {cfg.lora.alpha}, learning "
                 f"rate {g.lr:g}; refresh by `{cfg.refresh.mode}`; engine `{ENGINE}`."))

# %% [markdown]
# ## Open the run
# `RunSession.open` does what `lorabench run` does: checks the config, data and model, builds and
# warm-starts the tiny model on first use (cached afterwards by its recipe, in `~/.cache/lorabench`
# or `$LORABENCH_CACHE`, where notebook 03 and `lorabench demo` find it too), creates the run
# directory (`config.json`, then per step `metrics.jsonl`, `sync.jsonl`, `rollouts.jsonl` and a
# checkpoint), starts the engine with the trainer's adapter, and scores held-out problems before
# the first step. It also chooses torch's CPU threads (`run.threads=0`: as many as other work on
# the machine leaves free; its line below says how many). The bar below follows each part.

# %%
with WaitProgress("opening the run") as progress:
    session = RunSession.open(cfg, run_dir, progress=progress)
    progress("greedy answers to three held-out problems")
    problems = session.trainer.source.eval_set(3)                          # shown again after the run
    answers_before = explain.greedy_completions(session.trainer, problems)  # adapter v0: the warm-started model
sampled, greedy = session.before
print(f"held-out reward before GRPO: {sampled['strict']:.2f} sampled, {greedy['strict']:.2f} greedy "
      f"({greedy['n']} problems; {greedy['format']:.0%} of greedy answers end with '#### N', "
      f"{greedy['flexible']:.0%} have the right last number in any format)")

# %% [markdown]
# ## One step by hand
# Before the panel runs it many times, here is step 1's computation with the package's own
# functions, on the very problems and sampling seed step 1 will use: sample each problem's group
# from the engine, score it, turn rewards into advantages, take the log-probs of the sampled tokens
# and the clipped loss, and its gradient. Shapes: N = P × G completions, L = the longest prompt +
# completion.

# %%
t = session.trainer
problems_1 = t.source.train_batch(1, g.prompts_per_step)    # the problems step 1 draws (a function of seed and step)
rollouts = rollout.sample(t.engine, t.tokenizer, problems_1, g.group_size, t.sampling(1),
                          t.refresher.serving_adapter, t.enable_thinking)       # P × G completions from the engine
rewards, _ = rollout.score(rollouts, t.rewards)                                  # [N] group by group
batch = rollout.collate(rollouts, rewards, t.tokenizer.pad_token_id).to(t.device)  # padded tensors
advantages = loss.group_advantages(batch.rewards, g.group_size)                  # [N] normalised within each group
with t.policy.compute():                                                         # the trainer's precision
    logp = loss.token_logprobs(t.model, batch.input_ids, batch.attention_mask, g.temperature,
                               positions=batch.completion_mask.bool())          # [N, L-1] log π_θ, with gradients
old_logp = logp.detach()                                                         # [N, L-1] π_old: before the update
ratio = torch.exp(logp - old_logp)                                               # [N, L-1] ρ = π_θ / π_old
objective, loss_parts = loss.grpo_loss(logp, old_logp, advantages, batch.completion_mask, g.clip_eps)
objective.backward()                                                             # the gradient step 1 takes
grad_norm = explain.gradient_norm(t.policy.params)                               # ‖∇‖, then .grad cleared again
mask = batch.completion_mask.bool()
explain.tensor_shapes({
    "batch.input_ids": (batch.input_ids, "prompt + completion tokens, right-padded"),
    "batch.completion_mask": (batch.completion_mask, "1 where token t+1 is a completion token"),
    "rewards": (rewards, "the reward of each completion"),
    "advantages": (advantages, "(reward − group mean) / (group std + eps), one per completion"),
    "logp": (logp, f"log π_θ of each sampled token; mean {logp[mask].mean().item():.3f} over the completion tokens"),
    "ratio": (ratio, f"π_θ / π_old per token: {ratio[mask].min().item():g} to {ratio[mask].max().item():g}"),
    "objective": (objective, f"the loss: {objective.item():+.2e}; its gradient's norm {grad_norm:.3g}"),
})

# %% [markdown]
# **Predict first.** Here are the rewards of one group with a learning signal (its rewards not all
# equal). Before you look at its advantages, work out the advantage of its best completion:
# A = (r − mean(r)) / (std(r) + 0.0001), the mean and the standard deviation over the group's G
# completions (divided by G). Write your number into `my_prediction` in the cell after them, run it,
# then run the table.

# %%
equal = explain.equal_reward_groups(batch.rewards, g.group_size)                 # groups whose advantages are all 0
shown = next((i for i in range(g.prompts_per_step) if i not in equal), 0)        # the first group that is not
Markdown(explain.group_rewards_note(batch.rewards, g.group_size, shown))

# %%
my_prediction = None   # your advantage of the group's best completion, e.g. 1.5

# %% [markdown]
# The group completion by completion, with the answer the reward read (the number after the last
# `#### `) and the end of each completion, where that answer is; the panel's table shows the same
# for its last group. The loss term of a completion is `grpo_loss` on that row alone,
# −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) averaged over its tokens; the loss is the mean of these terms over
# all N completions.

# %%
display(explain.fit_table(explain.group_view(batch, rollouts.texts, logp, old_logp, shown, g.group_size, g.clip_eps),
                          {"reward": "{:.2f}", "advantage": "{:+.2f}", "mean log π": "{:.3f}",
                           "mean ratio ρ": "{:.3f}", "loss term": "{:+.3f}"}))
display(Markdown(explain.prediction_note(my_prediction, batch.rewards, g.group_size, shown) + "\n\n" +
                 explain.advantage_note(batch.rewards, g.group_size, shown) + "\n\n" +
                 f"**Why the loss is ~0 but the gradient is not.** Inside a step π<sub>old</sub> is the same "
                 f"weights, so ρ = 1 on every token ({loss_parts['clip_fraction']:.0%} clipped) and each "
                 f"completion's term is −A<sub>i</sub>; the terms of a group sum to 0, so the loss is "
                 f"{objective.item():+.1e}. Its gradient, the mean over completions of −A<sub>i</sub> times the "
                 f"gradient of their mean log π, is not 0: its norm is {grad_norm:.3g}. That is the step."))

# %% [markdown]
# ## The panel
# **Step** runs one GRPO step, **Run N** runs N, **Stop** stops after the current step. Steps run
# in a background thread, so the kernel stays free; a second click while a run is going is refused.
#
# The line under the buttons follows the adapter's versions: step k samples with adapter
# v(k−1), trains it into v(k) and refreshes v(k) into the engine, so step k+1 samples from it.
# While a Run N goes it shows a bar with the time left. Then one line each for the three numbers to
# watch:
# - **reward**: 1 for a completion whose last `#### N` has the right number, else 0 (no partial
#   credit, no format bonus unless `grpo.format_bonus` is set);
# - **probe gap**: how far the adapter has moved the served model, measured by the engine on one
#   fixed held-out answer, with the adapter and without it;
# - **mismatch**: the trainer's and the engine's log-probs of the tokens just sampled. Far below
#   the probe gap means the engine served exactly the trainer's adapter; with a stale or missing
#   adapter it would not be (the "break it yourself" section below measures how far it goes).

# %%
panel = StepPanel(session.trainer)
display(panel)

# %% [markdown]
# The same as clicking **Run N** with N = `STEPS`; this cell waits for the run to finish, so the
# cells below see all of it (a click would not block). The panel's line shows the progress.

# %%
panel.start(STEPS)
last = panel.wait()   # the last step's record (StepRecord: .metrics, .refresh, .samples)

# %% [markdown]
# ## What the run did
# One row per step from `metrics.jsonl` (the panel's plots, as numbers), with the policy's KL to the
# base model (k3 estimator on the sampled tokens, adapter disabled) and its entropy (nats per
# token): metrics only, neither is in this run's loss (`grpo.kl_beta` = 0; what a KL penalty would
# add is computed under the table).

# %%
rows = session.metrics()
columns = {"step": "step", "adapter/served_version": "sampled with", "adapter/version": "trained to",
           "reward/mean": "reward", "reward/strict_format": "ends '#### N'",
           "completions/last_number_right": "last number right", "advantage/active_groups": "groups with signal",
           "kl/mean": "KL to base", "entropy/mean": "entropy", "probe/adapter_gap": "probe gap",
           "mismatch/mean": "mismatch mean", "mismatch/p99": "mismatch p99", "refresh/total_s": "refresh s",
           "time/step_s": "step s"}
table = pd.DataFrame(rows)[list(columns)].rename(columns=columns).set_index("step")
explain.fit_table(table, {"reward": "{:.3f}", "ends '#### N'": "{:.3f}", "last number right": "{:.3f}",
                    "groups with signal": "{:.0%}", "KL to base": "{:.2e}", "entropy": "{:.3f}",
                    "probe gap": "{:.2e}", "mismatch mean": "{:.2e}", "mismatch p99": "{:.2e}",
                    "refresh s": "{:.3f}", "step s": "{:.2f}"})   # one line per step, nothing cut

# %%
Markdown(explain.kl_penalty_note(rows, g.kl_beta))   # beside the KL column: what a KL penalty would add

# %% [markdown]
# Held-out problems the run never trained on, before the first step and now (the same scoring
# as `lorabench demo`; sampled at the training temperature, and greedy):

# %%
with WaitProgress("held-out evaluation after the run") as progress:
    progress("sampled")
    after = [session.trainer.evaluate(greedy=False)]
    progress("greedy")
    after.append(session.trainer.evaluate(greedy=True))
session.runlog.set_evals(session.trainer.step_count, after)   # evals.jsonl, as the CLI writes it
evals = {"before GRPO": session.before, f"after {session.trainer.step_count} steps": after}
pd.DataFrame({name: [s["strict"], g_["strict"], g_["format"], g_["flexible"]] for name, (s, g_) in evals.items()},
             index=["reward, sampled", "reward, greedy", "greedy: ends with '#### N'",
                    "greedy: last number right, any format"]).style.format("{:.2f}")

# %% [markdown]
# ## What the run really learned
# The reward counts a completion only if it ends with `#### N` and N is right. The left plot puts
# it beside the two things it mixes: the share of completions ending with `#### N`, and the share
# whose last number is right in any format. Each step's problems are fresh, so its points measure
# the policy on problems it has not trained on; the squares and diamonds are the held-out greedy
# evaluations. Middle and right: how far the policy moved from the base model (KL) and how sure it
# became (entropy).

# %%
fig = run_learned_figure(rows, session.runlog.evals())

# %%
learned_text = explain.learned_summary(session.before[1], after[1])   # every direction word from the numbers
Markdown(learned_text)

# %% [markdown]
# The right format with a wrong number still scores 0, and the reward cannot tell "learned to
# answer" from "learned to end with `####`": the held-out row "last number right, any format" is
# the one that can.
#
# Step 1's batch again, scored by the trained adapter: the ratio ρ = π<sub>θ</sub> / π<sub>old</sub>
# that the clip bounds.

# %%
with torch.no_grad(), t.policy.compute():
    logp_now = loss.token_logprobs(t.model, batch.input_ids, batch.attention_mask, g.temperature,
                                   positions=mask)                               # [N, L-1] the trained policy
ratio_now = torch.exp(logp_now - old_logp)                                       # [N, L-1]
display(Markdown(explain.clip_note(ratio_now, batch.completion_mask, g.clip_eps, t.step_count)))

# %% [markdown]
# Three held-out problems answered greedily before the first step (adapter v0: LoRA starts at
# zero, so this is the warm-started model) and now:

# %%
pd.DataFrame({"question": [p.question for p in problems], "answer": [p.ground_truth for p in problems],
              "before GRPO": answers_before, "after": explain.greedy_completions(session.trainer, problems)}
             ).style.set_properties(**{"white-space": "pre-wrap", "text-align": "left"}).hide(axis="index")

# %% [markdown]
# ## Write your own reward
# A reward is a plain function `fn(prompts, completions, answers, **kwargs) -> list[float]`, one
# number per completion (`lorabench/rewards.py` has the run's own). The one below pays 0.1 for a
# completion under 100 characters; the cell adds it to the trainer's rewards, a list of
# `(name, fn, weight)`, and the panel above takes `EXERCISE_STEPS` steps with it: its reward line
# gains a term `+ 1 × short`, and `reward/short/mean` is logged with every step. **Predict first:**
# will the completions be shorter over these steps than over as many steps before? Then change the
# rule (pay for something else, or weight it higher) and run the cell again.

# %%
def short(prompts, completions, answers, **kwargs):
    return [0.1 if len(c) < 100 else 0.0 for c in completions]


panel.wait()
own = [*session.trainer.rewards, ("short", short, 1.0)]
session.trainer.rewards = own
panel.start(EXERCISE_STEPS)
panel.wait()
session.trainer.rewards = [r for r in own if r[0] != "short"]   # the run goes on with its configured reward
Markdown(explain.reward_exercise_note(session.metrics(), "short", EXERCISE_STEPS))

# %% [markdown]
# The held-out evaluation still scores GSM8K correctness, and the run dir does not record the
# change: a resumed run uses `grpo.reward_mode` and `grpo.format_bonus`.
#
# ## Break it yourself
# What if the adapter never reached the engine? Set `broken_mode` to `"none"`, the stale-adapter
# control (`lorabench run --help-config` lists the modes: `none` loads the first adapter, then never
# updates it), and run the cell: a second trainer on the same engine, under an adapter name of its
# own, takes `BREAK_STEPS` steps on the same problems as the run above. Watch the mismatch against
# the probe gap, and the reward. Then try `"tensor"` or `"file"`: the two runs agree again. (Let the
# panel finish first: the two trainers share the engine.)

# %%
broken_mode = "none"
panel.wait()
break_steps = min(BREAK_STEPS, len(rows))   # compared step by step with the run above
broken = build_trainer(Config.load(None, [*settings, f"refresh.mode={broken_mode}", "engine.adapter_name=broken"]),
                       session.model_path, session.engine, log=lambda *_: None)
with WaitProgress(f"{break_steps} steps with refresh.mode={broken_mode}") as progress:
    for i in range(break_steps):
        progress("GRPO steps", i, break_steps)
        broken.step()
        progress("GRPO steps", i + 1, break_steps)
broken.close()
session.engine.unload_adapter("broken")   # the session's own adapter was never touched
fig = broken_refresh_figure(rows, broken.history, broken_mode)

# %%
broken_text = explain.broken_summary(rows, broken.history, g.prompts_per_step * g.group_size, broken_mode)
Markdown(broken_text)

# %% [markdown]
# The trainer trains on completions from a policy it no longer has, and the reward, earned by the
# engine's completions, measures the first adapter whatever the trainer learns: nothing in the
# reward itself says why it does not move. The check that catches it is the mismatch, and the engine's report of the version it
# served (the refreshed run above refuses rollouts from an older version; `none` is exempt, as the
# control it is).
#
# ## When you are done: close the session
# Run All leaves the session open, so the panel above keeps working: step it further, then come
# back here. While the session is open, this kernel holds the run directory's lock and any other
# writer, `lorabench resume` included, is refused (naming this kernel's PID). **Close the session**
# waits for a running step, disables the panel (its views stay), releases the engine and the lock,
# and shows the command that continues the run from a shell.

# %%
closer = SessionCloser(panel, session, extra_steps=STEPS)
display(closer)
if CLOSE_AT_END:   # without a person to click: close now, the way the button does
    closer.click()

# %% [markdown]
# Run the command from the repository root. `grpo.steps` is the total to reach: the resumed run
# appends its steps to the same files, from the last checkpoint (every step writes one).
#
# ## Self-check
# The collapsed cell below checks what this lesson told you, from the numbers on screen and the
# run's own files.

# %% tags=["self-check"] jupyter={"source_hidden": true}
logged = read_jsonl(run_dir / "metrics.jsonl")
step_1 = [r for r in read_jsonl(run_dir / "rollouts.jsonl") if r["step"] == 1]
same_batch = [r["completion"] for r in step_1] == rollouts.texts[:len(step_1)]
group_sums = advantages.view(-1, g.group_size).sum(1)
before, now = [e for e in read_jsonl(run_dir / "evals.jsonl") if e["greedy"] and e["step"] in (0, STEPS)]


def fits(word, first, second, se):   # the lesson's rule for a share or a reward: a change beyond two standard errors
    return {"rose": second - first > 2 * se, "fell": first - second > 2 * se, "held": abs(second - first) <= 2 * se}[word]


def fits_fold(word, first, second):   # and for the mismatch, which moves by decades: beyond 10-fold
    return {"rose": second > 10 * first, "fell": second < first / 10, "held": first / 10 <= second <= 10 * first}[word]


per_step = g.prompts_per_step * g.group_size
reward_changes = []
for history in (broken.history, logged[:break_steps]):
    (first_half, se_1), (second_half, se_2) = explain.half_means(history, per_step)
    reward_changes.append((first_half, second_half, (se_1 ** 2 + se_2 ** 2) ** 0.5))
mismatch_word, *reward_words = explain.stated_directions(broken_text)
mismatch_ends = broken.history[0]["mismatch/mean"], broken.history[break_steps - 1]["mismatch/mean"]
gap_over_mismatch = logged[break_steps - 1]["probe/adapter_gap"] / max(mismatch_ends[1], 1e-12)
checks = {
    "in each group of step 1 the advantages sum to ~0": bool(group_sums.abs().max() < 1e-3),
    "a group with equal rewards has all-zero advantages":
        all(bool((advantages.view(-1, g.group_size)[i] == 0).all()) for i in equal),
    "inside a step the ratio is exactly 1, and the loss ~0": bool((ratio[mask] == 1).all())
        and abs(objective.item()) < 1e-3,
    "the KL to the base model is 0 at step 1 (LoRA starts at zero) and the entropy within [0, log V]":
        abs(logged[0]["kl/mean"]) < 1e-6 and all(0 <= r["entropy/mean"] <= torch.log(torch.tensor(
            t.model.config.vocab_size)).item() for r in logged),
    "each step sampled from the adapter of the step before":
        all(r["adapter/served_version"] == r["adapter/version"] - 1 for r in logged),
    "with the refresh on, the mismatch stays far below the probe gap (last step: under a tenth)":
        logged[STEPS - 1]["mismatch/mean"] < 0.1 * logged[STEPS - 1]["probe/adapter_gap"],
    "the sentence about format and correctness says what the held-out numbers say": all(
        fits(word, before[k], now[k], explain.share_se(before[k], now[k], now["n"]))
        and f"{before[k]:.2f} → {now[k]:.2f}" in learned_text
        for word, k in zip(explain.stated_directions(learned_text), ("format", "flexible", "strict"))),
    "the sentences about the broken run say what its numbers say (mismatch, probe gap, reward)":
        fits_fold(mismatch_word, *mismatch_ends) and all(fits(w, *c) for w, c in zip(reward_words, reward_changes))
        and ("of the order of the refreshed run's probe gap" in broken_text) == (1 / 3 <= gap_over_mismatch <= 3),
    "the run dir holds what `lorabench resume` needs (config, checkpoint, evaluations)":
        (run_dir / "config.json").is_file() and (run_dir / "checkpoint").is_dir()
        and len(read_jsonl(run_dir / "evals.jsonl")) == 4,
}
exercise = logged[-EXERCISE_STEPS:]
reward_parts = {name: weight for name, _, weight in own}
checks["your reward was logged with each of its steps, and reward/mean is the weighted sum of the parts"] = all(
    abs(r["reward/mean"] - sum(w * r[f"reward/{name}/mean"] for name, w in reward_parts.items())) < 1e-4
    for r in exercise)
checks["the reveal's advantage is the table's, the mean of the group's advantages 0"] = (
    f"**{advantages.view(-1, g.group_size)[shown].max().item():+.2f}**" in
    explain.prediction_note(None, batch.rewards, g.group_size, shown)
    and abs(advantages.view(-1, g.group_size)[shown].mean().item()) < 1e-4)
if broken_mode == "none":
    checks["with refresh.mode=none the engine served one adapter version at every step, the trainer's first"] = {
        r["adapter/served_version"] for r in broken.history} == {logged[0]["adapter/served_version"]}
if ENGINE == "hf":   # seeded sampling on the hf engine repeats exactly; SGLang's batched kernels need not
    checks["step 1 trained on the completions sampled by hand above"] = same_batch
    checks["step 1's logged gradient norm is the one computed by hand"] = abs(
        logged[0]["grad_norm"] - grad_norm) <= 1e-3 * grad_norm
explain.self_check(checks)
