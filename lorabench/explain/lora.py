"""One LoRA layer's factors, base vs adapter-applied predictions, and a refresh as a timeline."""
from __future__ import annotations

import torch

from ..adapters import base_weights
from ..viz import MIN_FONT_PT, PART_COLORS, label_axes, labelled_figure


def lora_factors(peft_model, module: str = "model.layers.0.self_attn.q_proj", adapter: str = "default") -> dict:
    """A [r, in], B [out, r], scaling α/r, the frozen W [out, in] and ΔW = (α/r)·B·A of one layer."""
    layer = peft_model.get_submodule(f"base_model.model.{module}")
    a = layer.lora_A[adapter].weight.detach().float().cpu()          # [r, in]
    b = layer.lora_B[adapter].weight.detach().float().cpu()          # [out, r]
    w = layer.base_layer.weight.detach().float().cpu()               # [out, in]
    scaling = float(layer.scaling[adapter])
    return {"module": module, "A": a, "B": b, "scaling": scaling, "W": w, "delta": scaling * (b @ a)}


def plot_lora_factors(f: dict):
    """B [out, r] and A [r, in], each on its own symmetric colour scale (ΔW: `plot_delta_w`)."""
    fig, axes = labelled_figure("lora_factors", 1, 2, figsize=(13, 3.4), gridspec_kw={"width_ratios": [0.45, 1]},
                                title=f"{f['module']}: the LoRA factors, rank r = {f['A'].shape[0]}")
    for ax, (m, title) in zip(axes, [(f["B"], f"B {tuple(f['B'].shape)}, its own scale"),
                                     (f["A"], f"A {tuple(f['A'].shape)}, its own scale")]):
        lim = float(m.abs().max()) or 1.0
        im = ax.imshow(m.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
        ax.set_title(title, loc="left")
        fig.colorbar(im, ax=ax, fraction=0.046)
    return fig


@torch.no_grad()
def lora_layer_facts(peft_model, f: dict, n_inputs: int = 3, seed: int = 0) -> dict:
    """The ΔW picture measured on the layer: its output on random x is W·x + ΔW·x, rank(ΔW) <= r."""
    layer = peft_model.get_submodule(f"base_model.model.{f['module']}")
    x = torch.randn(n_inputs, f["W"].shape[1], generator=torch.Generator().manual_seed(seed))
    param = next(layer.parameters())
    y = layer(x.to(device=param.device, dtype=param.dtype)).float().cpu()
    return {"r": f["A"].shape[0], "α/r": f["scaling"], "rank of ΔW": int(torch.linalg.matrix_rank(f["delta"])),
            "max |layer(x) − (W + ΔW)·x|": float((y - x @ (f["W"] + f["delta"]).T).abs().max()),
            "‖ΔW‖ / ‖W‖": float(f["delta"].norm() / f["W"].norm())}


def facts_frame(facts: dict, column: str):
    """Facts as a one-column table: whole numbers as they are, others to 3 digits, tiny ones as 1.2e-07."""
    import pandas as pd

    def text(v):
        if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e6):
            return f"{v:g}"
        return f"{v:.1e}" if isinstance(v, float) and abs(v) < 1e-3 else f"{v:.3g}"
    return pd.Series({k: text(v) for k, v in facts.items()}).to_frame(column)


@torch.no_grad()
def next_token_topk(peft_model, tokenizer, prefix_ids: list[int], k: int = 8) -> dict:
    """Next-token probabilities, adapter on and off: both top-k, by the adapter's probability."""
    ids = torch.tensor([prefix_ids], device=peft_model.device)
    with_adapter = torch.softmax(peft_model(input_ids=ids).logits[0, -1].float(), -1).cpu()
    with peft_model.disable_adapter():
        base = torch.softmax(peft_model(input_ids=ids).logits[0, -1].float(), -1).cpu()
    top = torch.cat([base.topk(k).indices, with_adapter.topk(k).indices]).unique()
    top = top[torch.argsort(with_adapter[top], descending=True)]
    return {"tokens": [repr(tokenizer.decode([int(t)])) for t in top], "base": base[top], "adapter": with_adapter[top]}


def plot_topk(topk: dict, title: str = "Next token, base vs adapter"):
    _, ax = labelled_figure("next_token_topk", figsize=(7, 1.2 + 0.32 * len(topk["tokens"])))
    y = torch.arange(len(topk["tokens"])).float()
    ax.barh(y - 0.2, topk["base"].numpy(), height=0.4, color="#999999", label="base (no adapter)")
    ax.barh(y + 0.2, topk["adapter"].numpy(), height=0.4, color="#4c72b0", label="adapter applied")
    ax.set_yticks(y.tolist(), topk["tokens"])
    ax.invert_yaxis()
    return label_axes(ax, title, ncol=2, axis="x", xlim=(0, 1), xlabel="next-token probability")


def logprob_difference(engine, sequence: list[int], prompt_len: int, adapter: str) -> torch.Tensor:
    """Engine log-prob of each completion token with the adapter minus without it: [T]."""
    return engine.score([sequence], [prompt_len], adapter)[0] - engine.score([sequence], [prompt_len], None)[0]


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """Each token as it reads in a plot: newlines as ⏎, a blank token as its repr."""
    return [t.replace("\n", "⏎") if t.strip() else repr(t) for t in (tokenizer.decode([i]) for i in ids)]


def top_effects(tokens: list[str], diff: torch.Tensor, k: int = 3) -> list[tuple[int, str, float]]:
    """The `k` tokens with the largest |Δ log-prob|: (position, token, Δ), largest first."""
    order = diff.abs().argsort(descending=True)[:k].tolist()
    return [(i, tokens[i], float(diff[i])) for i in order]


def plot_logprob_difference(tokens: list[str], diff: torch.Tensor):
    _, ax = labelled_figure("per_token_effect", figsize=(12, 3.6))
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


def plot_refresh_timeline(rows: list[dict], title: str = "One refresh, part by part"):
    """One bar per refresh_bench row: its parts in the order they ran, the total and bytes at the end."""
    _, ax = labelled_figure("refresh_timeline", figsize=(12, 1.8 + 0.5 * len(rows)))
    seen = set()
    for i, row in enumerate(rows):
        t = 0.0
        for part, seconds in row["parts"].items():
            ax.barh(i, 1e3 * seconds, left=t, color=PART_COLORS.get(part), edgecolor="white",
                    label=None if part in seen else part)
            seen.add(part)
            t += 1e3 * seconds
        ax.text(t, i, f"  {t:.1f} ms, {row['bytes'] / 2**20:.2f} MB moved", va="center")
    ax.set_yticks(range(len(rows)), [r["mode"] for r in rows])
    ax.invert_yaxis()
    return label_axes(ax, title, ncol=7, axis="x", xlabel="ms since the refresh started",
                      xlim=(0, 1.45e3 * max(r["total_s"] for r in rows)))


@torch.no_grad()
def restore_base_weights(engine, peft_model) -> None:
    """Undo a merged refresh: push the trainer's frozen base weights back into the engine."""
    engine.update_weights(list(base_weights(peft_model).items()), flush_cache=True, version=0)
