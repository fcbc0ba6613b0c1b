"""Teaching helpers for notebooks/03_how_hotswap_works: look inside one LoRA layer (its factors, ΔW
beside W on one colour scale, ΔW's singular values), compare base and adapter-applied predictions,
draw a refresh as a timeline, the check behind each failure mode, refreshed vs stale runs, and a
progress bar for the lesson's long waits.

Every number here comes from the real trainer model and the real engine; the plots take plain
tensors or rows so they can be redrawn from saved runs.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from matplotlib.ticker import MaxNLocator

from .adapters import base_param_name
from .data import prompt_ids
from .loss import token_logprobs
from .progress import WaitProgress
from .viz import MIN_FONT_PT, PART_COLORS, title_with_legend


# --- one LoRA layer ------------------------------------------------------------------------------
def lora_factors(peft_model, module: str = "model.layers.0.self_attn.q_proj", adapter: str = "default") -> dict:
    """A [r, in], B [out, r], scaling α/r, the frozen W [out, in] and ΔW = (α/r)·B·A of one layer."""
    layer = peft_model.get_submodule(f"base_model.model.{module}")
    a = layer.lora_A[adapter].weight.detach().float().cpu()          # [r, in]
    b = layer.lora_B[adapter].weight.detach().float().cpu()          # [out, r]
    scaling = float(layer.scaling[adapter])
    w = layer.base_layer.weight.detach().float().cpu()               # [out, in]
    return {"module": module, "A": a, "B": b, "scaling": scaling, "W": w, "delta": scaling * (b @ a)}


def plot_lora_factors(f: dict):
    """The two factors a LoRA layer learns, B [out, r] and A [r, in], each on its own symmetric
    colour scale (their product ΔW is drawn by `plot_delta_w`, beside W)."""
    r = f["A"].shape[0]
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.4), gridspec_kw={"width_ratios": [0.45, 1]}, layout="constrained")
    fig.set_label("lora_factors")
    for ax, (m, title) in zip(axes, [(f["B"], f"B {tuple(f['B'].shape)}, its own scale"),
                                     (f["A"], f"A {tuple(f['A'].shape)}, its own scale")]):
        lim = float(m.abs().max()) or 1.0
        im = ax.imshow(m.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
        ax.set_title(title, loc="left")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"{f['module']}: the LoRA factors, rank r = {r}", x=0.01, ha="left")
    return fig


@torch.no_grad()
def lora_layer_facts(peft_model, f: dict, n_inputs: int = 3, seed: int = 0) -> dict:
    """What the ΔW picture claims, measured on the layer itself: its output on random inputs equals
    W·x + ΔW·x, and ΔW's rank is at most r."""
    layer = peft_model.get_submodule(f"base_model.model.{f['module']}")
    x = torch.randn(n_inputs, f["W"].shape[1], generator=torch.Generator().manual_seed(seed))
    param = next(layer.parameters())
    y = layer(x.to(device=param.device, dtype=param.dtype)).float().cpu()
    return {"r": f["A"].shape[0], "α/r": f["scaling"], "rank of ΔW": int(torch.linalg.matrix_rank(f["delta"])),
            "max |layer(x) − (W + ΔW)·x|": float((y - x @ (f["W"] + f["delta"]).T).abs().max()),
            "‖ΔW‖ / ‖W‖": float(f["delta"].norm() / f["W"].norm())}


# --- base vs adapter-applied predictions -------------------------------------------------------------
@torch.no_grad()
def next_token_topk(peft_model, tokenizer, prefix_ids: list[int], k: int = 8) -> dict:
    """Next-token probabilities after `prefix_ids`, adapter on and off: the union of both top-k,
    ordered by the adapter's probability."""
    ids = torch.tensor([prefix_ids], device=peft_model.device)
    with_adapter = torch.softmax(peft_model(input_ids=ids).logits[0, -1].float(), -1).cpu()
    with peft_model.disable_adapter():
        base = torch.softmax(peft_model(input_ids=ids).logits[0, -1].float(), -1).cpu()
    top = torch.cat([base.topk(k).indices, with_adapter.topk(k).indices]).unique()
    top = top[torch.argsort(with_adapter[top], descending=True)]
    return {"tokens": [repr(tokenizer.decode([int(t)])) for t in top], "base": base[top], "adapter": with_adapter[top]}


def plot_topk(topk: dict, ax=None, title: str = "Next token, base vs adapter"):
    ax = ax or plt.subplots(figsize=(7, 1.2 + 0.32 * len(topk["tokens"])), layout="constrained")[1]
    ax.figure.set_label("next_token_topk")
    y = torch.arange(len(topk["tokens"])).float()
    ax.barh(y - 0.2, topk["base"].numpy(), height=0.4, color="#999999", label="base (no adapter)")
    ax.barh(y + 0.2, topk["adapter"].numpy(), height=0.4, color="#4c72b0", label="adapter applied")
    ax.set_yticks(y.tolist(), topk["tokens"])
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("next-token probability")
    title_with_legend(ax, title, ncol=2)
    ax.grid(alpha=0.3, axis="x")
    return ax


def logprob_difference(engine, sequence: list[int], prompt_len: int, adapter: str) -> torch.Tensor:
    """Engine log-prob of each completion token with the adapter minus without it: [T]."""
    with_adapter = engine.score([sequence], [prompt_len], adapter)[0]
    base = engine.score([sequence], [prompt_len], None)[0]
    return with_adapter - base


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """Each token as it reads in a plot: newlines as ⏎, a blank token as its repr."""
    labels = [tokenizer.decode([t]) for t in ids]
    return [t.replace("\n", "⏎") if t.strip() else repr(t) for t in labels]


def top_effects(tokens: list[str], diff: torch.Tensor, k: int = 3) -> list[tuple[int, str, float]]:
    """The `k` tokens with the largest |Δ log-prob|: (position, token, Δ), largest first."""
    order = diff.abs().argsort(descending=True)[:k].tolist()
    return [(i, tokens[i], float(diff[i])) for i in order]


def plot_logprob_difference(tokens: list[str], diff: torch.Tensor, ax=None):
    ax = ax or plt.subplots(figsize=(12, 3.6), layout="constrained")[1]
    ax.figure.set_label("per_token_effect")
    colors = ["#55a868" if v >= 0 else "#c44e52" for v in diff.tolist()]
    ax.bar(range(len(diff)), diff.numpy(), color=colors)
    ax.set_xticks(range(len(tokens)), tokens, rotation=0 if len(tokens) <= 24 else 90, fontsize=MIN_FONT_PT + 1)
    ax.set_xlim(-0.7, len(tokens) - 0.3)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_ylabel("log p(adapter) − log p(base)")
    ax.set_title("Per-token effect of the adapter on the reference answer (engine log-probs; green: more likely)",
                 loc="left")
    ax.grid(alpha=0.3, axis="y")
    return ax


# --- a refresh as a timeline ----------------------------------------------------------------------------
def plot_refresh_timeline(rows: list[dict], ax=None, title: str = "One refresh, part by part"):
    """One row per refresh (refresh_bench rows): its parts end to end, in the order they ran; the
    parts are named in the legend above the axes, the total and bytes at the end of each bar."""
    ax = ax or plt.subplots(figsize=(12, 1.8 + 0.5 * len(rows)), layout="constrained")[1]
    ax.figure.set_label("refresh_timeline")
    seen = set()
    for i, row in enumerate(rows):
        t = 0.0
        for part, seconds in row["parts"].items():
            ms = 1e3 * seconds
            ax.barh(i, ms, left=t, color=PART_COLORS.get(part), edgecolor="white",
                    label=None if part in seen else part)
            seen.add(part)
            t += ms
        ax.text(t, i, f"  {t:.1f} ms, {row['bytes'] / 2**20:.2f} MB moved", va="center")
    ax.set_yticks(range(len(rows)), [r["mode"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the refresh started")
    ax.set_xlim(0, 1.45e3 * max(r["total_s"] for r in rows))
    title_with_legend(ax, title, ncol=7)
    ax.grid(alpha=0.3, axis="x")
    return ax


@torch.no_grad()
def restore_base_weights(engine, peft_model) -> None:
    """Undo a merged refresh: push the trainer's frozen base weights back into the engine."""
    plain = [(base_param_name(n), p.detach()) for n, p in peft_model.named_parameters() if ".lora_" not in n]
    engine.update_weights(plain, flush_cache=True, version=0)  # the plain base weights again


# --- the checks ---------------------------------------------------------------------------------------
def rollout_sequences(trainer, n_prompts: int = 2, adapter: str | None = "serving") -> tuple[list, list]:
    """Greedy engine completions for held-out prompts: (prompt + completion token lists, prompt lengths).
    `adapter='serving'` uses the adapter the trainer's refresher serves."""
    name = trainer.refresher.serving_adapter if adapter == "serving" else adapter
    prompts = [prompt_ids(trainer.tokenizer, p.messages) for p in trainer.source.eval_set(n_prompts)]
    outs = trainer.engine.generate(prompts, trainer.sampling(greedy=True), adapter=name)
    return [o.prompt_ids + o.token_ids for o in outs], [len(o.prompt_ids) for o in outs]


def greedy_completions(trainer, problems, adapter: str | None = "serving") -> list[str]:
    """The engine's greedy completion of each problem, as text: with the adapter the trainer's
    refresher serves (`'serving'`), another adapter name, or None for the base model."""
    name = trainer.refresher.serving_adapter if adapter == "serving" else adapter
    prompts = [prompt_ids(trainer.tokenizer, p.messages) for p in problems]
    outs = trainer.engine.generate(prompts, trainer.sampling(greedy=True), adapter=name)
    return trainer.tokenizer.batch_decode([o.token_ids for o in outs], skip_special_tokens=True)


@torch.no_grad()
def trainer_vs_engine(trainer, sequences: list[list[int]], prompt_lens: list[int], adapter: str | None) -> dict:
    """|trainer log-prob − engine log-prob| over the completion tokens (mean, p99, max): the check that
    a request ran the trainer's current policy (GRPO logs it every step as mismatch/mean, /p99, /max).
    The mean and p99 are the robust figures; the max of one token is a rounding tail in bf16.
    Both sides score at temperature 1 whatever the run samples at: the check is about the weights, a
    temperature divides both sides' logits alike, and SGLang's prefill scores at temperature 1 only."""
    engine_lp = trainer.engine.score(sequences, prompt_lens, adapter)
    diffs = []
    for seq, plen, lp in zip(sequences, prompt_lens, engine_lp):
        ids = torch.tensor([seq], device=trainer.device)
        mine = token_logprobs(trainer.model, ids, torch.ones_like(ids), 1.0)[0, plen - 1:].cpu()
        diffs.append((mine - lp).abs())
    diffs = torch.cat(diffs)
    return {"mean": diffs.mean().item(), "p99": diffs.quantile(0.99).item(), "max": diffs.max().item()}


def self_check(checks: dict[str, bool]) -> None:
    """Print each check with ✓ or ✗; raise AssertionError naming the failed ones."""
    for name, ok in checks.items():
        print(f"{'✓' if ok else '✗'} {name}")
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        raise AssertionError(f"self-check failed: {failed}")
    print(f"self-check: all {len(checks)} checks passed")


# --- notebook 01: one step by hand, what the run learned, a broken refresh ------------------------------
def gradient_norm(params, clear: bool = True) -> float:
    """‖∇‖ over `params` (what grpo logs as grad_norm: before clipping); their .grad set back to None
    when `clear`, so the next optimizer step starts from nothing."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item() if grads else 0.0
    if clear:
        for p in params:
            p.grad = None
    return norm


def tensor_shapes(tensors: dict[str, tuple[torch.Tensor, str]]):
    """One row per tensor: its shape, dtype and what it holds (the shape comments, on screen)."""
    import pandas as pd
    return pd.DataFrame([{"tensor": name, "shape": str(list(t.shape)), "dtype": str(t.dtype).replace("torch.", ""),
                          "what it holds": what} for name, (t, what) in tensors.items()]).set_index("tensor")


def group_view(batch, texts: list[str], logp, old_logp, group: int, group_size: int, clip_eps: float,
               max_chars: int = 70):
    """Completion by completion, one group of a batch: reward, advantage, completion tokens, mean log π
    and mean ratio over its tokens, and its term of the loss (`loss.grpo_loss` on that row alone: the
    batch's loss is the mean of these terms)."""
    import pandas as pd

    from .loss import grpo_loss
    rows = []
    for i in range(group * group_size, (group + 1) * group_size):
        mask = batch.completion_mask[i:i + 1]
        tokens = mask.sum().clamp(min=1)
        term, _ = grpo_loss(logp[i:i + 1].detach(), old_logp[i:i + 1], batch.advantages[i:i + 1], mask, clip_eps)
        ratio = torch.exp(logp[i].detach() - old_logp[i])
        rows.append({"completion": texts[i][:max_chars].replace("\n", " ⏎ "), "reward": batch.rewards[i].item(),
                     "advantage": batch.advantages[i].item(), "tokens": int(mask.sum()),
                     "mean log π": ((logp[i].detach() * mask[0]).sum() / tokens).item(),
                     "mean ratio ρ": ((ratio * mask[0]).sum() / tokens).item(), "loss term": term.item()})
    return pd.DataFrame(rows).rename_axis(f"group {group}")


def equal_reward_groups(rewards: torch.Tensor, group_size: int) -> list[int]:
    """The groups whose rewards are all equal: their advantages are all 0, so they add no gradient."""
    groups = rewards.view(-1, group_size)                                   # [P, G]
    return [i for i, g in enumerate(groups) if bool((g == g[0]).all())]


def advantage_note(rewards: torch.Tensor, group_size: int, group: int = 0) -> str:
    """Markdown: the advantage formula as `loss.group_advantages` computes it (its eps read from the
    function), worked out for `group`, and how many of the batch's groups have all-equal rewards."""
    import inspect

    from .loss import group_advantages
    eps = inspect.signature(group_advantages).parameters["eps"].default
    groups = rewards.view(-1, group_size)
    r = groups[group]
    mean, std = r.mean().item(), r.std(unbiased=False).item()
    equal = equal_reward_groups(rewards, group_size)
    worked = "; ".join(f"reward {v:g} → {(v - mean) / (std + eps):+.2f}" for v in sorted(set(r.tolist())))
    which = f" (group{'s' if len(equal) > 1 else ''} {', '.join(map(str, equal))})" if equal else ""
    return (f"**The advantage column.** `loss.group_advantages` gives completion *i* of a group "
            f"A<sub>i</sub> = (r<sub>i</sub> − mean(r)) / (std(r) + {eps:g}), with the mean and the population "
            f"standard deviation (divided by G = {group_size}) of that group's rewards. The same A<sub>i</sub> "
            f"goes to every token of the completion, and a group's advantages sum to 0: completions better than "
            f"their group are pushed up, worse ones down. Group {group} here: mean {mean:.2f}, std {std:.2f}, so "
            f"{worked}.\n\n"
            f"A group whose rewards are all equal has std 0 and every advantage exactly 0: it adds nothing to "
            f"the gradient, whatever its reward. In this batch **{len(equal)} of {groups.shape[0]} groups** had "
            f"equal rewards{which}, so {groups.shape[0] - len(equal)} carry the learning signal.")


def direction(before: float, after: float, se: float) -> str:
    """'rose', 'fell' or 'held': a change counts only beyond two standard errors `se` of the
    difference (so 'held' means within that noise)."""
    if abs(after - before) <= 2 * se or after == before:
        return "held"
    return "rose" if after > before else "fell"


def stated_directions(text: str) -> list[str]:
    """The direction words of a generated sentence, in order ('rose', 'fell', 'held')."""
    import re
    return re.findall(r"\b(rose|fell|held)\b(?!-)", text)


def share_se(before: float, after: float, n: int) -> float:
    """Standard error of the difference of two shares, each measured on n items."""
    return ((before * (1 - before) + after * (1 - after)) / n) ** 0.5


def learned_summary(before: dict, after: dict) -> str:
    """Markdown that says what this run learned, from the greedy held-out evaluations before and
    after (dicts of GRPOTrainer.evaluate: 'format', 'flexible', 'strict', 'n'); every direction word
    comes from `direction`, never assumed."""
    n = after["n"]
    fmt, right, reward = (direction(before[k], after[k], share_se(before[k], after[k], n))
                          for k in ("format", "flexible", "strict"))
    verdict = {("rose", "fell"): "the reward was learned, the arithmetic got worse",
               ("rose", "held"): "the run learned the format the reward pays for, not the arithmetic",
               ("rose", "rose"): "the run learned the format, and more answers are right in any format too"
               }.get((fmt, right), f"the format did not catch on in this run (it {fmt}), and any-format "
                                   f"correctness {right}")
    return (f"**What this run learned** ({n} held-out problems, greedy): ending with `#### N` {fmt} "
            f"({before['format']:.2f} → {after['format']:.2f}), the last number right in any format {right} "
            f"({before['flexible']:.2f} → {after['flexible']:.2f}), and the reward, which needs both, {reward} "
            f"({before['strict']:.2f} → {after['strict']:.2f}): **{verdict}**. (A change within two standard "
            f"errors of a share of {n} problems is called *held*.)")


def clip_note(ratio: torch.Tensor, mask: torch.Tensor, clip_eps: float, steps: int) -> str:
    """Markdown: the ratio ρ = π_now / π_old on a batch's completion tokens after `steps` updates, and
    the share of tokens the clip would hold at 1 ± ε were the batch trained on again."""
    values = ratio[mask.bool()]
    outside = ((values - 1).abs() > clip_eps).float().mean().item()
    return (f"After {steps} steps the ratio ρ = π<sub>θ</sub> / π<sub>old</sub> on these tokens spans "
            f"{values.min().item():.2f} to {values.max().item():.2f} (median {values.median().item():.2f}); "
            f"{outside:.0%} of them are outside [1 − ε, 1 + ε] = [{1 - clip_eps:g}, {1 + clip_eps:g}], where the "
            f"clip holds ρ fixed and their gradient is 0. Inside one step ρ starts at exactly 1 (π<sub>old</sub> "
            f"is the same weights), so with `grpo.epochs = 1` the clip never acts; it matters when a batch is "
            f"trained on more than once (`grpo.epochs` > 1).")


def half_means(rows: list[dict], per_step: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(mean, standard error) of reward/mean over the first and the second half of `rows`; a step's
    standard error is its completions' reward/std over sqrt(per_step)."""
    half = max(1, len(rows) // 2)

    def mean_se(part):
        mean = sum(r["reward/mean"] for r in part) / len(part)
        return mean, (sum(r["reward/std"] ** 2 / per_step for r in part) ** 0.5) / len(part)
    return mean_se(rows[:half]), mean_se(rows[half:] or rows[:half])


FOLD = 10.0   # a mismatch spans decades (1e-7 when the engine serves the trainer's adapter, 1e-2 when not)


def fold_direction(before: float, after: float) -> str:
    """'rose' or 'fell' for a change beyond FOLD-fold either way, else 'held': the direction word for a
    quantity that moves by decades, like the mismatch."""
    fold = after / max(before, 1e-12)
    return "rose" if fold > FOLD else "fell" if fold < 1 / FOLD else "held"


def broken_summary(refreshed: list[dict], broken: list[dict], per_step: int, mode: str = "none") -> str:
    """Markdown: what the run with refresh.mode=`mode` showed against the refreshed run over the same
    steps: the mismatch at its first and last step, against the refreshed run's mismatch and probe gap
    there, and the reward's direction in each run (first half of the steps against the second, within
    two standard errors: `direction`); `per_step`: completions per step."""
    k = min(len(broken), len(refreshed))
    first, last = broken[0]["mismatch/mean"], broken[k - 1]["mismatch/mean"]
    ref_last, gap_last = refreshed[k - 1]["mismatch/mean"], refreshed[k - 1]["probe/adapter_gap"]
    fold = last / max(first, 1e-12)
    climb = {"rose": f"rose {fold:.2g}-fold", "fell": f"fell {1 / fold:.2g}-fold",
             "held": f"held (×{fold:.2g}: under {FOLD:g}-fold either way)"}[fold_direction(first, last)]
    served = [r["adapter/served_version"] for r in broken[:k]]
    engine = (f"the engine served adapter version {served[0]} at every step while the trainer moved on to version "
              f"{broken[k - 1]['adapter/version']}" if len(set(served)) == 1 else
              f"the engine served versions {served[0]} to {served[-1]} while the trainer moved on to version "
              f"{broken[k - 1]['adapter/version']}")
    scale = gap_last / last if last > 0 else float("inf")
    where = ("of the order of the refreshed run's probe gap" if 1 / 3 <= scale <= 3 else
             f"{max(scale, 1 / scale):.0f}× {'below' if scale > 3 else 'above'} the refreshed run's probe gap")
    words = []
    for rows in (broken[:k], refreshed[:k]):
        (a, se_a), (b, se_b) = half_means(rows, per_step)
        words.append((direction(a, b, (se_a ** 2 + se_b ** 2) ** 0.5), a, b))
    (word_b, a_b, b_b), (word_r, a_r, b_r) = words
    return (f"**What breaking it showed** (`refresh.mode={mode}`, {k} steps on the same problems as the run "
            f"above): {engine}. The mismatch {climb}, "
            f"from {first:.1e} nats at step 1 (the engine still had the trainer's adapter) to {last:.1e} at step "
            f"{k}: {last / max(ref_last, 1e-12):.2g}× the refreshed run's {ref_last:.1e} there, and {where} "
            f"({gap_last:.2g}). The reward, earned by the engine's completions, {word_b} (mean {a_b:.2f} over the "
            f"first half of the steps, {b_b:.2f} over the second); in the refreshed run it {word_r} "
            f"({a_r:.2f} → {b_r:.2f}). *Held* means within two standard errors.")


# --- notebook 02: what a refresh does to the engine's memory, and what its timings say ------------------
# (imports inside the functions: this section is notebook 02's alone)
def engine_lora_weight(engine, adapter: str, module: str, half: str = "lora_B") -> torch.Tensor:
    """The hf engine's own tensor for `half` of `module` in its adapter `adapter`: PEFT's parameter, not
    a copy. The engine protocol has no such accessor (callers never reach into an engine's weights);
    a lesson looks all the same. SGLang's copy lives in its scheduler process, out of this one's reach."""
    peft_model = getattr(engine, "_peft", None) if getattr(engine, "name", "") == "hf" else None
    if peft_model is None or adapter not in engine.loaded_adapters():
        raise ValueError(f"engine_lora_weight reads an hf engine holding adapter {adapter!r}; got "
                         f"{getattr(engine, 'name', type(engine).__name__)} with {engine.loaded_adapters()}")
    return getattr(peft_model.base_model.model.get_submodule(module), half)[adapter].weight


@torch.no_grad()
def storage_across_refresh(engine, peft_model, mode: str, module: str = "model.layers.0.self_attn.q_proj",
                           adapter_name: str = "storage", seed: int = 0) -> dict:
    """Refresh `peft_model`'s adapter into the hf `engine` by `mode`, change the trainer's LoRA weights
    as an optimizer step does, refresh again, and look at the engine's lora_B of `module`: where its
    values live before and after (storage pointers) and which values each holds. A handle on the
    engine's tensor is kept across the second refresh; it keeps the old memory alive, so a new
    tensor cannot be given the old address by chance."""
    from .adapters import PEFT_PREFIX
    from .engines.base import AdapterNotLoaded
    from .policy import LoraLayers
    from .refresh import make_refresher, refresh_settings
    layers = LoraLayers(peft_model, flatten=True)   # as the policy keeps them
    refresher = make_refresher(refresh_settings(mode), engine, adapter_name)
    try:
        refresher.refresh(layers.snapshot(0))
        held = engine_lora_weight(engine, adapter_name, module)
        old = held.detach().clone()
        gen = torch.Generator(device=layers.buffer.device).manual_seed(seed)
        layers.buffer.add_(1e-3 * torch.randn(layers.buffer.shape, generator=gen, device=layers.buffer.device,
                                              dtype=layers.buffer.dtype))   # "an optimizer step"
        new = layers.snapshot(1)
        refresher.refresh(new)
        now = engine_lora_weight(engine, adapter_name, module)
        trainer = new.tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"].to(now.device, now.dtype)
        return {"mode": mode, "tensor": f"{module}.lora_B {tuple(now.shape)}",
                "storage before": held.untyped_storage().data_ptr(), "storage after": now.untyped_storage().data_ptr(),
                "data_ptr before": held.data_ptr(), "data_ptr after": now.data_ptr(),
                "values changed": not torch.equal(now, old), "engine = trainer": torch.equal(now, trainer),
                "old handle reads": "the new values" if torch.equal(held, now) else
                                    "the old values" if torch.equal(held, old) else "neither",
                "before": old.flatten()[:3].tolist(), "after": now.flatten()[:3].tolist()}
    finally:
        refresher.close()
        try:
            engine.unload_adapter(adapter_name)
        except AdapterNotLoaded:
            pass


def storage_table(results: list[dict]):
    """storage_across_refresh results as a table (pointers in hex, the first values rounded)."""
    import pandas as pd
    rows = [{"mode": r["mode"], "engine tensor": r["tensor"], "storage before": hex(r["storage before"]),
             "storage after": hex(r["storage after"]), "same storage": r["storage before"] == r["storage after"],
             "first values before": ", ".join(f"{v:+.5f}" for v in r["before"]),
             "first values after": ", ".join(f"{v:+.5f}" for v in r["after"]),
             "engine = trainer's new values": r["engine = trainer"], "old handle reads": r["old handle reads"]}
            for r in results]
    return pd.DataFrame(rows).set_index("mode")


def storage_markdown(results: list[dict]) -> str:
    """What the table shows, from its own values."""
    lines = []
    for r in results:
        same = r["storage before"] == r["storage after"]
        lines.append(f"- `{r['mode']}`: the engine's tensor is {'the same' if same else 'a new'} storage after the "
                     f"refresh ({'pointer unchanged' if same else 'pointer changed'}), its values "
                     f"{'changed' if r['values changed'] else 'did not change'}, it "
                     f"{'equals' if r['engine = trainer'] else 'does not equal'} the trainer's new weights, and the "
                     f"handle taken before the refresh reads {r['old handle reads']}.")
    return "\n".join(lines)


def _median_ms(row) -> float:
    from .viz import end_to_end_ms, quartiles
    return quartiles(end_to_end_ms(row))[1]


def _overlap(a: list[float], b: list[float]) -> bool:
    """Whether the middle halves (interquartile ranges) of two samples overlap."""
    from .viz import quartiles
    qa, qb = quartiles(a), quartiles(b)
    return qa[0] <= qb[2] and qb[0] <= qa[2]


def mode_groups(rows) -> list[list[str]]:
    """Modes by median end to end, fastest first, in groups: a mode whose middle half overlaps the
    previous mode's joins its group (their order is within the spread and can swap between runs)."""
    from .viz import end_to_end_ms
    groups: list[list[dict]] = []
    for row in sorted(rows, key=_median_ms):
        if groups and _overlap(end_to_end_ms(groups[-1][-1]), end_to_end_ms(row)):
            groups[-1].append(row)
        else:
            groups.append([row])
    return [[r["mode"] for r in g] for g in groups]


def modes_markdown(rows, bandwidth_gbps: float) -> str:
    """Section 1's reading, computed from its rows: the order of the medians (with what the spread
    allows), the largest part of each call, and the distance to the floor."""
    from .refresh_bench import floor_seconds
    from .viz import ms_text
    by_mode = {r["mode"]: r for r in rows}
    groups = mode_groups(rows)
    order = " < ".join(" ≈ ".join(f"`{m}` {ms_text(_median_ms(by_mode[m]))} ms" for m in g) for g in groups)
    tied = [g for g in groups if len(g) > 1]
    spread = ("; ≈ joins modes whose middle halves overlap: their order is within the spread and can swap "
              "between runs" if tied else "; every mode's middle half is clear of the next one's")
    largest = ", ".join(f"`{r['mode']}` {max(r['parts'], key=r['parts'].get)} "
                        f"({100 * max(r['parts'].values()) / r['total_s']:.0f}% of its call)" for r in rows)
    ratios = {r["mode"]: r["total_s"] / floor_seconds(r["bytes"], bandwidth_gbps) for r in rows}
    near, far = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
    return (f"- Fastest to slowest by median end to end: {order}{spread}.\n"
            f"- The largest part of each median call: {largest}.\n"
            f"- Each median call against its floor: from {ratios[near]:,.0f}× (`{near}`) to {ratios[far]:,.0f}× "
            f"(`{far}`).")


def buckets_markdown(rows) -> str:
    """Section 3's reading, computed from its merged rows: the push counts, whether the median push
    part grows at every step toward more pushes, the line through the medians and how close they sit
    to it, and the rest of the call, which the bucket size does not touch."""
    from .viz import call_ms, ms_text, part_ms, push_cost_fit, quartiles
    rows = sorted(rows, key=lambda r: r["buckets"])
    pushes = [part_ms(r, "push") for r in rows]
    medians = [quartiles(p)[1] for p in pushes]
    counts = ", ".join(f"{r['buckets']} ({r['bucket_mb']:g} MB)" for r in rows)
    falls = [(a, b, pa, pb) for a, b, pa, pb, ma, mb in zip(rows, rows[1:], pushes, pushes[1:], medians, medians[1:])
             if mb < ma]
    if not falls:
        trend = "From the fewest pushes to the most, the median push part grows at every step."
    else:
        steps = ", ".join(f"{a['buckets']} -> {b['buckets']} pushes{' (within the spread)' if _overlap(pa, pb) else ''}"
                          for a, b, pa, pb in falls)
        trend = f"The median push part does not grow at every step toward more pushes: it falls from {steps}."
    fixed, per_push = push_cost_fit(rows)
    worst = max(abs(m - (fixed + per_push * r["buckets"])) for r, m in zip(rows, medians))
    rest = [quartiles([c - p for c, p in zip(call_ms(r), part)])[1] for r, part in zip(rows, pushes)]
    return (f"- Pushes (bucket size): {counts}; {rows[0]['bytes'] / 2**20:.3g} MB of weights at every size.\n"
            f"- {trend}\n"
            f"- A straight line through the medians: {ms_text(fixed)} ms {'+' if per_push >= 0 else '−'} "
            f"{abs(per_push):.2g} ms per push; the medians sit within {ms_text(worst, 2)} ms of it.\n"
            f"- The rest of the call (snapshot and merge), which the bucket size does not change: a median of "
            f"{ms_text(min(rest))} to {ms_text(max(rest))} ms across the bucket sizes.")


def _rank_tiers(at: dict, modes: list[str], ranks: list[int]) -> list[list[str]]:
    """The modes in tiers that hold at every rank, fastest first: a cut between two tiers stands where,
    at every rank, each mode before it has its middle half below the middle half of each mode after it
    (the order within a tier can change with the rank)."""
    from .viz import end_to_end_ms, quartiles
    q = {key: quartiles(end_to_end_ms(row)) for key, row in at.items()}
    order = sorted(modes, key=lambda m: q[(m, ranks[0])][1])
    cuts = [s for s in range(1, len(order))
            if all(max(q[(m, k)][2] for m in order[:s]) < min(q[(m, k)][0] for m in order[s:]) for k in ranks)]
    bounds = [0, *cuts, len(order)]
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]


def rank_markdown(rows) -> str:
    """Section 4's reading, computed from its rows: how the adapter's bytes and each mode's median end
    to end change from the smallest rank to the largest (and whether that change is within the
    spread), and the order of the modes that holds at every rank, if any does."""
    from .viz import end_to_end_ms
    ranks = sorted({r["rank"] for r in rows})
    low, high = ranks[0], ranks[-1]
    at = {(r["mode"], r["rank"]): r for r in rows}
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    size = {k: at[("tensor", k)]["bytes"] / 2**20 for k in (low, high)} if ("tensor", low) in at else None

    def change(m):
        within = _overlap(end_to_end_ms(at[(m, low)]), end_to_end_ms(at[(m, high)]))
        return f"`{m}` ×{_median_ms(at[(m, high)]) / _median_ms(at[(m, low)]):.2f}{' (within the spread)' * within}"
    tiers = _rank_tiers(at, modes, ranks)
    if len(tiers) > 1:
        order = (f"- At every rank: {' < '.join(', '.join(f'`{m}`' for m in t) for t in tiers)} (each group's "
                 f"middle halves below the next group's at every rank; within a group the order can change)")
    else:
        fastest = {k: min((at[(m, k)] for m in modes), key=_median_ms)["mode"] for k in ranks}
        order = ("- No mode's middle half is clear of another's at every rank; the fastest median at each: "
                 + ", ".join(f"r={k}: `{m}`" for k, m in fastest.items()))
    adapter = (f"the adapter grows ×{size[high] / size[low]:.0f} ({size[low]:.2g} MB -> {size[high]:.2g} MB)"
               if size else f"the adapter grows ×{high / low:.0f}")
    return (f"- From r={low} to r={high} {adapter}; each mode's median end to end changes by: "
            f"{', '.join(change(m) for m in modes)}.\n{order}.")


def threads_markdown(rows, cpus: int, load_average: float, chosen: int | None = None, asked: bool = False) -> str:
    """Section 0's reading: each thread count's median, upper quartile and slowest repeat, the machine's
    load, and the count the later sections time with (`chosen`: asked for, or refresh_bench.steadiest_threads's)."""
    from .viz import end_to_end_ms, ms_text, quartiles

    def threads(n):
        return f"{n} thread{'s' if n > 1 else ''}"
    parts = []
    for r in rows:
        _, median, upper = quartiles(end_to_end_ms(r))
        parts.append(f"{threads(r['threads'])}: median {ms_text(median)} ms, upper quartile {ms_text(upper)} ms, "
                     f"slowest {ms_text(max(end_to_end_ms(r)))} ms")
    text = f"- {'; '.join(parts)} (load average {load_average:.2g} on {cpus} CPUs while measured)."
    if chosen is not None:
        why = ("as `THREADS` asks" if asked else
               "the fewest threads whose upper quartile is within 10% of the lowest")
        text += f"\n- Sections 2-4 time with {threads(chosen)}: {why}."
    return text


# --- notebook 03: ΔW beside W on one colour scale, and ΔW's singular values ----------------------------
RANK_TOL = 1e-5   # σ_i / σ_1 below this is float32 rounding of B·A, not a direction ΔW has


@torch.no_grad()
def delta_w_spectrum(f: dict) -> dict:
    """Singular values of ΔW and W (float64, descending), the rank r, ΔW's numerical rank (σ_i >
    RANK_TOL·σ_1) and the cliff after r: σ_{r+1}/σ_r, and σ_{r+1}/σ_1."""
    r = f["A"].shape[0]
    s_delta = torch.linalg.svdvals(f["delta"].double())
    s_w = torch.linalg.svdvals(f["W"].double())
    first = float(s_delta[0]) or 1.0
    after = float(s_delta[r]) if len(s_delta) > r else 0.0
    return {"r": r, "delta": s_delta, "W": s_w, "rank": int((s_delta > RANK_TOL * first).sum()),
            "cliff": after / (float(s_delta[r - 1]) or 1.0), "after_r_vs_first": after / first}


def plot_delta_w(f: dict):
    """W and ΔW on ONE symmetric colour scale (W's), so their sizes compare at a glance, and ΔW again
    on its own scale, labelled with the magnification."""
    w_lim = float(f["W"].abs().max()) or 1.0
    d_lim = float(f["delta"].abs().max()) or w_lim
    zoom = w_lim / d_lim
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.0), layout="constrained")
    fig.set_label("delta_w")
    shared = dict(cmap="RdBu_r", vmin=-w_lim, vmax=w_lim, aspect="auto", interpolation="nearest")
    axes[0].imshow(f["W"].numpy(), **shared)
    axes[0].set_title(f"frozen W {tuple(f['W'].shape)}", loc="left")
    im = axes[1].imshow(f["delta"].numpy(), **shared)
    axes[1].set_title("ΔW on the same scale as W", loc="left")
    fig.colorbar(im, ax=axes[:2], fraction=0.03, label=f"shared scale ±{w_lim:.3g}")
    own = axes[2].imshow(f["delta"].numpy(), **{**shared, "vmin": -d_lim, "vmax": d_lim})
    axes[2].set_title(f"ΔW magnified ×{zoom:.0f} (own scale)", loc="left", color="#c44e52")
    fig.colorbar(own, ax=axes[2], fraction=0.046, label=f"own scale ±{d_lim:.2g}")
    rel = float(f["delta"].norm() / f["W"].norm())
    fig.suptitle(f"{f['module']}: ΔW = (α/r)·B·A beside W; ‖ΔW‖/‖W‖ = {rel:.2g}", x=0.01, ha="left")
    return fig


def plot_singular_values(spectrum: dict, module: str = ""):
    """ΔW's and W's singular values on a log axis, with the rank r marked: ΔW's fall off a cliff
    after index r, W's do not."""
    r = spectrum["r"]
    fig, ax = plt.subplots(figsize=(9, 3.8), layout="constrained")
    fig.set_label("delta_w_singular_values")
    tiny = torch.finfo(torch.float64).tiny   # a zero singular value has no place on a log axis
    for key, color, label in (("W", "#999999", "W (frozen)"), ("delta", "#4c72b0", "ΔW")):
        s = spectrum[key].clamp_min(tiny)
        ax.plot(range(1, len(s) + 1), s.numpy(), ".-", color=color, ms=4, lw=1, label=label)
    ax.axvline(r + 0.5, color="#c44e52", ls="--", lw=1, label=f"after index r = {r}")
    ax.set_yscale("log")
    ax.set(xlabel="index i (largest first)", ylabel="singular value σ_i")
    title_with_legend(ax, f"Singular values{f' of {module}' if module else ''}: "
                          f"σ_{r + 1}/σ_{r} = {spectrum['cliff']:.1g} for ΔW", ncol=3)
    ax.grid(alpha=0.3, which="both")
    return fig


def cliff_sentence(spectrum: dict) -> str:
    """What the singular values say, from the numbers (Markdown)."""
    r, rank, s = spectrum["r"], spectrum["rank"], spectrum["delta"]
    rank_text = (f"ΔW has rank {rank} = r" if rank == r else
                 f"ΔW has numerical rank {rank}, {'below' if rank < r else 'above'} r = {r}")
    return (f"σ<sub>{r + 1}</sub>/σ<sub>{r}</sub> = {spectrum['cliff']:.1g}: {rank_text} (counting the singular "
            f"values above {RANK_TOL:g}·σ<sub>1</sub>; what lies below is float32 rounding of B·A). Its "
            f"largest is σ<sub>1</sub> = {float(s[0]):.2g}, W's is {float(spectrum['W'][0]):.2g}; W has "
            f"{int((spectrum['W'] > RANK_TOL * spectrum['W'][0]).sum())} of {len(spectrum['W'])} above the same "
            f"threshold.")


# --- notebook 03: long waits shown as they go (progress.WaitProgress) ------------------------------------
WARM_START_LINE = re.compile(r"warm-start step (\d+)/(\d+)")


def resolve_model_shown(model, warmstart, seed: int) -> tuple[str, bool, float]:
    """The base model's path from the `model` and `warmstart` sections and run.seed (as
    session.resolve_model resolves it), with a progress bar when the tiny model must first be built
    and warm-started (it logs 'warm-start step k/N'); returns (path, built now?, seconds)."""
    from .models import model_ref, resolve_model_path
    from .tiny import tiny_cache_path
    t0 = time.perf_counter()
    if model_ref(model).kind != "tiny" or (tiny_cache_path(model.cache_dir, warmstart, seed) / "config.json").is_file():
        return resolve_model_path(model, warmstart, seed, log=lambda *a: None), False, time.perf_counter() - t0
    what = "building and warm-starting the tiny model (cached afterwards)"
    with WaitProgress(what) as progress:
        progress(what, 0, warmstart.steps)

        def log(line, *rest):
            found = WARM_START_LINE.search(str(line))
            if found:
                progress(what, int(found.group(1)), warmstart.steps)
        path = resolve_model_path(model, warmstart, seed, log=log)
    return path, True, time.perf_counter() - t0


def train_shown(trainer, steps: int, what: str = "GRPO steps") -> float:
    """`steps` trainer steps with a progress bar (reward and step time as its note); the seconds taken."""
    with WaitProgress(what) as progress:
        progress(what, 0, steps)
        for i in range(steps):
            t0 = time.perf_counter()
            m = trainer.step().metrics
            progress(what, i + 1, steps,
                     note=f"reward {m['reward/mean']:.2f}, last step {time.perf_counter() - t0:.1f} s")
        return progress.finish(f"reward of the last step {trainer.history[-1]['reward/mean']:.2f}")


# --- notebook 03: the adapter of a trained run, or one trained here ----------------------------------------
def last_mean(rows: list[dict], key: str = "reward/mean", last: int = 5) -> float:
    values = [r[key] for r in rows[-last:]]
    return sum(values) / len(values)


def use_trained_run(trainer, found: tuple, run_root: str | Path, steps: int) -> str:
    """Put the run `found` names (session.reuse.find_trained_run: (TrainedRun or None, passed over))
    into `trainer`, or, when there is none, train `steps` steps here (a progress bar); and say which
    happened, in Markdown, from what was found."""
    from .session.reuse import load_trained_run
    run, passed = found
    items = [f"- passed over `{name}`: {why}" for name, why in passed[:5]]
    items += [f"- and {len(passed) - 5} more passed over"] if len(passed) > 5 else []
    skipped = "\n\n" + "\n".join(items) if items else ""
    if run is not None:
        load_trained_run(trainer, run)
        writer = (" Another process holds its lock (it may still be training): this is its last checkpoint."
                  if run.in_use else "")
        text = (f"**Reused a checkpoint, not trained again:** `{run.dir}` at step {run.step}. The trainer now holds "
                f"that run's adapter (version {run.step}) and the engine serves it; the run dir was only read "
                f"(its config, its checkpoint with weights only, its metrics).{writer}{skipped}")
    else:
        seconds = train_shown(trainer, steps)
        text = (f"**Trained here:** no run dir of this experiment with a checkpoint under `{run_root}` (notebook 01 "
                f"and `lorabench demo` write there), so this kernel trained {steps} GRPO steps in {seconds:.0f} s, "
                f"writing nothing to disk.{skipped}")
    rows = trainer.history
    if rows:
        k = min(5, len(rows))
        text += (f"\n\nIts reward: {last_mean(rows[:k]):.2f} over the first {k} steps, {last_mean(rows, last=k):.2f} "
                 f"over the last {k}; answers ending '#### N': {last_mean(rows[:k], 'reward/strict_format'):.0%} "
                 f"→ {last_mean(rows, 'reward/strict_format', k):.0%}.")
    return text


# --- notebook 03: what a stale adapter does to learning -----------------------------------------------------
ARMS = ("refreshed", "stale")


def refreshed_vs_stale(make_trainer, steps: int, seeds) -> dict:
    """For each seed, two runs of `steps` GRPO steps from the same start, `make_trainer("refreshed",
    seed)` (refreshed after every step) and `make_trainer("stale", seed)` (refresh.mode=none), on one
    engine, each serving an adapter name of its own; then each trainer's held-out greedy reward with
    its own adapter served (the stale trainer's after one real refresh, with the trainer-vs-engine
    check before and after it) and, for the stale arm before that refresh, the first adapter's. A
    progress bar covers all of it."""
    seeds = list(seeds)
    out = {"seeds": seeds, "steps": steps, "rows": {a: [] for a in ARMS}, "heldout": {a: [] for a in ARMS},
           "first_adapter": [], "check": []}
    what, total = "refreshed and stale runs", 2 * steps * len(seeds)
    with WaitProgress(what) as progress:
        progress(what, 0, total)
        _compare_arms(make_trainer, steps, seeds, out, lambda done, note: progress(what, done, total, note=note))
    return out


def _compare_arms(make_trainer, steps: int, seeds: list, out: dict, progress) -> None:
    """refreshed_vs_stale's runs, into `out`; `progress(steps done, note)` after each step."""
    done = 0
    for seed in seeds:
        for arm in ARMS:
            trainer = make_trainer(arm, seed)
            try:
                for _ in range(steps):
                    reward = trainer.step().metrics["reward/mean"]
                    done += 1
                    progress(done, f"seed {seed}, {arm} run: step {trainer.step_count}, reward {reward:.2f}")
                out["rows"][arm].append(list(trainer.history))
                if arm == "stale":
                    out["first_adapter"].append(trainer.evaluate(greedy=True))   # the engine still serves v0
                    out["check"].append(refresh_once(trainer))
                out["heldout"][arm].append(trainer.evaluate(greedy=True))
            finally:
                trainer.close()
                name = trainer.refresher.serving_adapter
                if name in trainer.engine.loaded_adapters():   # the next arm's name is its own: free this one
                    trainer.engine.unload_adapter(name)


def refresh_once(trainer) -> dict:
    """The stale check: trainer vs engine on the engine's own greedy completions, before and after
    one real (tensor) refresh of the trainer's adapter; the version the engine served before it; and
    one group's GRPO loss (one_group_loss) on a held-out problem before and after, same sampling seed."""
    from .refresh import make_refresher
    name = trainer.refresher.serving_adapter
    served = trainer.engine.served_version(name)
    seqs, plens = rollout_sequences(trainer, 2)
    problem, next_step = trainer.source.eval_set(1)[0], trainer.step_count + 1
    before = trainer_vs_engine(trainer, seqs, plens, name)
    group_before = one_group_loss(trainer, problem, next_step)
    make_refresher("tensor", trainer.engine, name).refresh(trainer.policy.adapter())
    after = trainer_vs_engine(trainer, seqs, plens, name)
    return {"served_before": served, "served_after": trainer.engine.served_version(name), "trainer_version":
            trainer.step_count, "before": before, "after": after,
            "group_before": group_before, "group_after": one_group_loss(trainer, problem, next_step)}


def compare_summary(result: dict, last: int = 5) -> dict:
    """Per arm and seed, the mean reward of the last `last` steps; per seed, which arm's is higher."""
    per_seed = {a: [last_mean(rows, last=last) for rows in result["rows"][a]] for a in ARMS}
    pairs = list(zip(per_seed["refreshed"], per_seed["stale"]))
    return {"last": min(last, result["steps"]), "per_seed": per_seed,
            "mean": {a: sum(v) / len(v) for a, v in per_seed.items()},
            "refreshed_higher": sum(r > s for r, s in pairs), "stale_higher": sum(s > r for r, s in pairs),
            "heldout": {a: heldout_means(result["heldout"][a]) for a in ARMS},
            "first_adapter": heldout_means(result["first_adapter"]),
            "stale_served": sorted({r["adapter/served_version"] for rows in result["rows"]["stale"] for r in rows})}


HELDOUT_MEASURES = {"format": "answers ending '#### N'", "flexible": "last number right, any format",
                    "strict": "right and ending '#### N' (the strict reward)"}


def heldout_means(evaluations: list[dict]) -> dict[str, float]:
    """The mean over seeds of each held-out measure of GRPOTrainer.evaluate."""
    return {k: sum(e[k] for e in evaluations) / len(evaluations) for k in HELDOUT_MEASURES}


def heldout_table(summary: dict):
    """Held-out greedy measures (means over seeds) of the first adapter (what the stale engine served),
    the refreshed trainer's adapter and the stale trainer's (after one real refresh)."""
    import pandas as pd
    columns = {"first adapter (the stale engine's)": summary["first_adapter"],
               "refreshed trainer": summary["heldout"]["refreshed"],
               "stale trainer, after one refresh": summary["heldout"]["stale"]}
    table = pd.DataFrame({c: {HELDOUT_MEASURES[k]: v[k] for k in HELDOUT_MEASURES} for c, v in columns.items()})
    return table.style.format("{:.0%}")


ARM_COLORS = {"refreshed": "#4c72b0", "stale": "#c44e52"}


def plot_refreshed_vs_stale(result: dict):
    """Reward and trainer-vs-engine mismatch per step, refreshed vs stale: one thin line per seed,
    the mean over seeds thick."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.0), layout="constrained")
    fig.set_label("refreshed_vs_stale")
    floor = 1e-9   # a mismatch of exactly 0 has no place on a log axis
    for ax, key, transform in ((axes[0], "reward/mean", float), (axes[1], "mismatch/mean", lambda v: max(v, floor))):
        for arm in ARMS:
            runs = [[transform(r[key]) for r in rows] for rows in result["rows"][arm]]
            steps = range(1, result["steps"] + 1)
            for values in runs:
                ax.plot(steps, values, "-", color=ARM_COLORS[arm], alpha=0.35, lw=1)
            mean = [sum(v) / len(v) for v in zip(*runs)]
            ax.plot(steps, mean, "-", color=ARM_COLORS[arm], lw=2.5,
                    label=f"{arm}, mean of {len(runs)} seed{'s' if len(runs) > 1 else ''}")
        ax.plot([], [], "-", color="#777777", alpha=0.5, lw=1, label="one seed")
        ax.set_xlabel("GRPO step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_ylim(bottom=-0.02)   # rewards are >= 0; the top follows the data (a format bonus adds to 1)
    axes[0].set_ylabel("reward of the step's completions")
    axes[1].set(ylabel="|trainer − engine| log-prob, mean", yscale="log")
    title_with_legend(axes[0], "Reward: the engine's rollouts, scored", ncol=2)
    title_with_legend(axes[1], "Mismatch: does the engine serve the trainer's policy?", ncol=2)
    return fig


def _verdict(won: int, lost: int, n: int) -> str:
    """Which arm's reward was higher, seed by seed, in words."""
    if n == 1:
        return "the refreshed run's was higher" if won else "the stale run's was higher" if lost else "they were equal"
    if won == n or lost == n:
        return f"the {'refreshed' if won == n else 'stale'} run's was higher in every seed"
    ties = n - won - lost
    return (f"the refreshed run's was higher in {won} of {n} seeds, the stale run's in {lost}"
            + (f", equal in {ties}" if ties else ""))


def compare_sentence(summary: dict, steps: int) -> str:
    """What the comparison showed, from its numbers (Markdown); true whichever arm came out ahead."""
    n, k, mean = len(summary["per_seed"]["refreshed"]), summary["last"], summary["mean"]
    per = {a: ", ".join(f"{v:.2f}" for v in summary["per_seed"][a]) for a in ARMS}
    verdict = _verdict(summary["refreshed_higher"], summary["stale_higher"], n)
    text = (f"Over the last {k} of {steps} steps the refreshed runs' reward averaged **{mean['refreshed']:.2f}** "
            f"(per seed: {per['refreshed']}), the stale runs' **{mean['stale']:.2f}** ({per['stale']}): {verdict}. "
            f"These are {n} seed{'s' if n > 1 else ''} of {steps} steps on a small model: a difference no larger "
            f"than the spread between seeds (the thin lines) can be noise.")
    if summary["stale_served"] == [0]:
        text += (" The stale engine served adapter version 0 at every step, so the stale reward curve is the "
                 "first adapter's reward on each step's problems, whatever its trainer learned.")
    return text


def heldout_sentence(summary: dict) -> str:
    """How each trainer's adapter compares with the first one on held-out problems, measure by measure,
    from the numbers (Markdown)."""
    first, parts = summary["first_adapter"], []
    for k, what in HELDOUT_MEASURES.items():
        values = {arm: summary["heldout"][arm][k] for arm in ARMS}
        moved = [f"the {arm} trainer's {v:.0%} ({_relation(v, first[k])})" for arm, v in values.items()]
        parts.append(f"{what}: the first adapter {first[k]:.0%}, {', '.join(moved)}")
    return ("Held-out, greedy (means over the seeds), " + "; ".join(parts) + ". The stale trainer learned from "
            "the first adapter's rollouts only; what its own adapter does shows once it is served.")


def _relation(value: float, reference: float) -> str:
    """Higher, lower or the same, as the percentages shown (whole per cent) compare."""
    shown, ref = round(100 * value), round(100 * reference)
    return "higher" if shown > ref else "lower" if shown < ref else "the same"


# --- notebook 03: one group's advantages and clipped loss, and what a stale engine hides from it ---------
@torch.no_grad()
def one_group_loss(trainer, problem, step: int) -> dict:
    """One group of G completions for `problem`, sampled by the engine with the adapter the trainer's
    refresher serves (whatever version that is), then scored and turned into GRPO's advantages and
    clipped loss with the package's own functions (rollout.sample, score, collate: group_advantages;
    loss.token_logprobs, grpo_loss), twice: with π_old = the trainer's own log-probs, as Policy.train
    takes it, and with π_old = the log-probs of the policy that sampled the tokens (the engine's)."""
    from .loss import grpo_loss, token_logprobs
    from .rollout import collate, sample, score
    g, name = trainer.settings, trainer.refresher.serving_adapter
    rollouts = sample(trainer.engine, trainer.tokenizer, [problem], g.group_size, trainer.sampling(step), name,
                      trainer.enable_thinking)
    rewards, _ = score(rollouts, trainer.rewards)
    batch = collate(rollouts, rewards, trainer.tokenizer.pad_token_id).to(trainer.device)
    with trainer.policy.compute():
        logp = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, g.temperature).float()
    mask = batch.completion_mask                                                 # [G, L-1]
    own_loss, own = grpo_loss(logp, logp, batch.advantages, mask, g.clip_eps)    # what the trainer computes
    sampler_loss, sampler = grpo_loss(logp, batch.engine_logprobs, batch.advantages, mask, g.clip_eps)
    ratio = torch.exp(logp - batch.engine_logprobs)[mask.bool()].cpu()          # [tokens] π_θ / π_sampler
    return {"served_version": rollouts.served_version, "trainer_version": trainer.step_count,
            "clip_eps": g.clip_eps, "rewards": batch.rewards.cpu(), "advantages": batch.advantages.cpu(),
            "tokens": mask.sum(1).int().cpu(), "shapes": {"input_ids": tuple(batch.input_ids.shape),
                                                          "logp": tuple(logp.shape), "advantages":
                                                          tuple(batch.advantages.shape)},
            "texts": rollouts.texts, "ratio": ratio,
            "own": {"loss": own_loss.item(), **own}, "sampler": {"loss": sampler_loss.item(), **sampler}}


def group_table(group: dict, width: int = 60):
    """The group as rows: each completion's reward, advantage (r − mean) / std and tokens, and the
    mean ratio π_θ / π_sampler over its tokens."""
    import pandas as pd
    mask_lengths = group["tokens"].tolist()
    ratios, start = [], 0
    for n in mask_lengths:
        part = group["ratio"][start:start + n]
        ratios.append(float(part.mean()) if n else float("nan"))
        start += n
    return pd.DataFrame({"completion": [t.strip().replace("\n", " ⏎ ")[:width] for t in group["texts"]],
                         "reward r": group["rewards"].tolist(),
                         "advantage (r − mean)/std": group["advantages"].tolist(),
                         "tokens": mask_lengths, "mean π_θ/π_sampler": ratios})


def group_loss_table(groups: dict):
    """Per group (e.g. {"stale engine": g, "after one refresh": g2}): the loss and the share of tokens
    whose ratio lies outside 1 ± ε (grpo_loss's clip_fraction), with π_old = the trainer's own log-probs
    (what it computes) and with π_old = the policy that sampled the tokens."""
    import pandas as pd
    rows = {}
    for label, g in groups.items():
        lo, hi = float(g["ratio"].min()), float(g["ratio"].max())
        rows[f"{label}: engine served v{g['served_version']}, trainer at v{g['trainer_version']}"] = {
            "loss, π_old = trainer": g["own"]["loss"], "outside 1 ± ε, π_old = trainer": g["own"]["clip_fraction"],
            "loss, π_old = sampler": g["sampler"]["loss"],
            "outside 1 ± ε, π_old = sampler": g["sampler"]["clip_fraction"],
            "π_θ/π_sampler min": lo, "π_θ/π_sampler max": hi}
    return pd.DataFrame(rows).T


def group_loss_sentence(stale: dict, fresh: dict) -> str:
    """What the two groups show, from their numbers (Markdown)."""
    eps = stale["clip_eps"]

    def outside(g):
        return f"{g['sampler']['clip_fraction']:.0%}"
    return (f"With π_old = its own log-probs (as `Policy.train` takes it) the ratio is exactly 1: "
            f"{stale['own']['clip_fraction']:.0%} of the stale engine's tokens lie outside 1 ± {eps:g}, and "
            f"{fresh['own']['clip_fraction']:.0%} after the refresh. The loss cannot see who sampled them. Measured "
            f"against the policy that did sample them, the stale engine's tokens have ratios "
            f"from {float(stale['ratio'].min()):.2f} to {float(stale['ratio'].max()):.2f}, and {outside(stale)} of "
            f"them lie outside 1 ± {eps:g}; after one refresh {float(fresh['ratio'].min()):.3f} to "
            f"{float(fresh['ratio'].max()):.3f}, {outside(fresh)} outside. The stale trainer takes each step as if "
            f"its rollouts were its own; only the mismatch check (`mismatch/*`) tells them apart.")


# --- notebook 04: which LoRA rank does RL need? ------------------------------------------------------------
def rank_verdict(after: dict[str, dict], before: dict[str, dict], key: str = "strict") -> tuple[str, list[str]]:
    """Markdown that compares the policies' held-out `key` share after training (greedy evaluations:
    name -> trainer.evaluate row, in the order of what varies, e.g. the rank; `before`: the same
    before the first step), each with its standard error, and the names within two standard errors
    of the best (a tie at this sample size). Whatever the numbers are, the sentence says what they
    show: nothing learned yet, a tie, a gap at one end of the order, or one that does not follow it."""
    share = {name: e[key] for name, e in after.items()}
    n = next(iter(after.values()))["n"]
    se = {name: (p * (1 - p) / n) ** 0.5 for name, p in share.items()}
    listed = ", ".join(f"{name} {before[name][key]:.2f} → {share[name]:.2f} (± {se[name]:.2f})" for name in share)
    head = f"Held-out, greedy ({n} problems), the strict reward per policy before → after: {listed}."
    learned = [name for name in share
               if share[name] - before[name][key] > 2 * share_se(before[name][key], share[name], n)]
    if not learned:
        return (f"{head} No policy has improved by more than two standard errors yet: this run is too short (or its "
                f"sample too small) to say anything about rank. Run more steps (Run N above) and evaluate again.",
                list(share))
    best = max(share, key=share.get)
    tied = [name for name in share if share[best] - share[name] <= 2 * (se[best] ** 2 + se[name] ** 2) ** 0.5]
    if len(tied) == len(share):
        tail = (f"The best is {best}, and every policy is within two standard errors of it: at this size and length "
                f"of run the rank does **not** separate them, which is what LoRA Without Regret reports for "
                f"policy-gradient RL (rank 1 learning as well as much larger ranks).")
    else:
        names = list(share)   # in the order the policies were given: by rank in notebook 04
        behind = [name for name in names if name not in tied]
        at_one_end = behind in (names[:len(behind)], names[len(names) - len(behind):])
        tail = (f"The best is **{best}**; within two standard errors of it: {', '.join(tied)}; behind by more than "
                f"that: {', '.join(behind)}. "
                + ("Those behind are all at one end of the list, so here the rank **did** matter." if at_one_end else
                   "Those behind are not at one end of the list but between policies that did as well as the best, "
                   "so this does not follow the rank: on one seed it is as likely this run's chance (its samples, "
                   "its initialisation) as the rank's capacity. Run another seed to tell them apart."))
    return f"{head} {tail}", tied
