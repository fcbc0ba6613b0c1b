"""Teaching helpers for notebooks/03_how_hotswap_works: look inside one LoRA layer, compare base and
adapter-applied predictions, draw a refresh as a timeline, and the check behind each failure mode.

Every number here comes from the real trainer model and the real engine; the plots take plain
tensors or rows so they can be redrawn from saved runs.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from .adapters import base_param_name
from .grpo import token_logprobs
from .models import prompt_ids
from .viz import PART_COLORS


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
    """B, A and ΔW = (α/r)·B·A as images (each on its own symmetric colour scale), and W for scale."""
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.6), gridspec_kw={"width_ratios": [0.35, 1, 1, 1]})
    panels = [("B", f["B"], f"B {tuple(f['B'].shape)}"), ("A", f["A"], f"A {tuple(f['A'].shape)}"),
              ("delta", f["delta"], f"ΔW = ({f['scaling']:g})·B·A {tuple(f['delta'].shape)}"),
              ("W", f["W"], f"frozen W {tuple(f['W'].shape)}")]
    for ax, (_, m, title) in zip(axes, panels):
        lim = float(m.abs().max()) or 1.0
        im = ax.imshow(m.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
    rel = float(f["delta"].norm() / f["W"].norm())
    fig.suptitle(f"{f['module']}: rank of ΔW ≤ r = {f['A'].shape[0]}; ‖ΔW‖/‖W‖ = {rel:.2e}", fontsize=10)
    fig.tight_layout()
    return fig


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


def plot_topk(topk: dict, ax=None):
    ax = ax or plt.subplots(figsize=(6, 0.4 + 0.3 * len(topk["tokens"])))[1]
    y = torch.arange(len(topk["tokens"])).float()
    ax.barh(y - 0.2, topk["base"].numpy(), height=0.4, color="#999999", label="base (no adapter)")
    ax.barh(y + 0.2, topk["adapter"].numpy(), height=0.4, color="#4c72b0", label="adapter applied")
    ax.set_yticks(y.tolist(), topk["tokens"], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="next-token probability", title="Top next tokens, base vs adapter")
    ax.legend(fontsize=7)
    return ax


def logprob_difference(engine, sequence: list[int], prompt_len: int, adapter: str) -> torch.Tensor:
    """Engine log-prob of each completion token with the adapter minus without it: [T]."""
    with_adapter = engine.score([sequence], [prompt_len], adapter)[0]
    base = engine.score([sequence], [prompt_len], None)[0]
    return with_adapter - base


def plot_logprob_difference(tokens: list[str], diff: torch.Tensor, ax=None):
    ax = ax or plt.subplots(figsize=(10, 3))[1]
    colors = ["#55a868" if v >= 0 else "#c44e52" for v in diff.tolist()]
    ax.bar(range(len(diff)), diff.numpy(), color=colors)
    labels = [t.replace("\n", "⏎") if t.strip() else repr(t) for t in tokens]
    ax.set_xticks(range(len(tokens)), labels, rotation=90, fontsize=7)
    ax.axhline(0, color="k", lw=0.5)
    ax.set(ylabel="log p(adapter) − log p(base)", title="Per-token effect of the adapter (engine log-probs)")
    return ax


# --- a refresh as a timeline ----------------------------------------------------------------------------
def plot_refresh_timeline(rows: list[dict], ax=None):
    """One row per refresh (refresh_bench rows): its parts end to end, in the order they ran."""
    ax = ax or plt.subplots(figsize=(9, 0.8 + 0.6 * len(rows)))[1]
    seen = set()
    for i, row in enumerate(rows):
        t = 0.0
        for part, seconds in row["parts"].items():
            ms = 1e3 * seconds
            ax.barh(i, ms, left=t, color=PART_COLORS.get(part), edgecolor="white",
                    label=None if part in seen else part)
            if ms > 0.04 * 1e3 * row["total_s"]:
                ax.text(t + ms / 2, i, part, ha="center", va="center", fontsize=7, color="white")
            seen.add(part)
            t += ms
        ax.text(t, i, f"  {t:.1f} ms, {row['bytes'] / 2**20:.2f} MB", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r["mode"] for r in rows])
    ax.invert_yaxis()
    ax.set(xlabel="ms since the refresh started", title="One refresh, part by part")
    ax.set_xlim(0, 1.35e3 * max(r["total_s"] for r in rows))
    ax.legend(fontsize=7, loc="lower right", ncol=3)
    return ax


@torch.no_grad()
def restore_base_weights(engine, peft_model) -> None:
    """Undo a merged refresh: push the trainer's frozen base weights back into the engine."""
    plain = [(base_param_name(n), p.detach()) for n, p in peft_model.named_parameters() if ".lora_" not in n]
    engine.update_weights(plain, flush_cache=True)


# --- the checks ---------------------------------------------------------------------------------------
def rollout_sequences(trainer, n_prompts: int = 2, adapter: str | None = "serving") -> tuple[list, list]:
    """Greedy engine completions for held-out prompts: (prompt + completion token lists, prompt lengths).
    `adapter='serving'` uses the adapter the trainer's refresher serves."""
    from .engines.base import Sampling
    name = trainer.refresher.serving_adapter if adapter == "serving" else adapter
    prompts = [prompt_ids(trainer.tokenizer, p.messages) for p in trainer.source.eval_set(n_prompts)]
    outs = trainer.engine.generate(prompts, Sampling(trainer.cfg.grpo.max_new_tokens, 0.0), adapter=name)
    return [o.prompt_ids + o.token_ids for o in outs], [len(o.prompt_ids) for o in outs]


@torch.no_grad()
def trainer_vs_engine(trainer, sequences: list[list[int]], prompt_lens: list[int], adapter: str | None) -> dict:
    """|trainer log-prob − engine log-prob| over the completion tokens (mean and max): the check that
    a request ran the trainer's current policy (GRPO logs it every step as mismatch/mean, /max)."""
    temperature = trainer.cfg.grpo.temperature
    engine_lp = trainer.engine.score(sequences, prompt_lens, adapter, temperature=temperature)
    diffs = []
    for seq, plen, lp in zip(sequences, prompt_lens, engine_lp):
        ids = torch.tensor([seq], device=trainer.device)
        mine = token_logprobs(trainer.model, ids, torch.ones_like(ids), temperature)[0, plen - 1:].cpu()
        diffs.append((mine - lp).abs())
    diffs = torch.cat(diffs)
    return {"mean": diffs.mean().item(), "max": diffs.max().item()}
