"""Figures shared by the CLI, the notebooks and the tests. Each function draws into a given Axes
(or makes one) from plain metric rows, so a notebook can redraw the same figure live."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt  # headless: matplotlib picks Agg by itself when there is no display

PART_COLORS = {"write": "#4c72b0", "snapshot": "#8172b2", "stage": "#64b5cd", "unload": "#dd8452",
               "load": "#55a868", "merge": "#937860", "push": "#c44e52"}


def _series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and not (isinstance(r[key], float) and math.isnan(r[key]))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _rolling(values, window=5):
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def plot_rewards(rows, evals=(), ax=None):
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    steps, reward = _series(rows, "reward/mean")
    ax.plot(steps, reward, ".", alpha=0.4, color="#4c72b0", label="train reward (fresh prompts)")
    ax.plot(steps, _rolling(reward), "-", color="#4c72b0", label="rolling mean (5)")
    steps_f, fmt = _series(rows, "reward/strict_format")
    ax.plot(steps_f, _rolling(fmt), "--", color="#55a868", label="'#### N' format (rolling)")
    for e in evals:
        if not e.get("greedy"):
            ax.plot([e["step"]], [e["strict"]], "D", color="#c44e52", ms=7)
    if any(not e.get("greedy") for e in evals):
        ax.plot([], [], "D", color="#c44e52", label="held-out strict reward")
    ax.set(xlabel="GRPO step", ylabel="reward", ylim=(-0.02, 1.02), title="Reward")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    return ax


def plot_refresh(rows, ax=None):
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    parts = sorted({k[len("refresh/"):-2] for r in rows for k in r
                    if k.startswith("refresh/") and k.endswith("_s") and k != "refresh/total_s"})
    bottom = [0.0] * len(rows)
    steps = [r["step"] for r in rows]
    for part in parts:
        vals = [1e3 * (r.get(f"refresh/{part}_s") or 0.0) for r in rows]
        ax.bar(steps, vals, bottom=bottom, color=PART_COLORS.get(part), label=part, width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals)]
    mode = rows[0].get("refresh/mode", "") if rows else ""
    ax.set(xlabel="GRPO step", ylabel="ms", title=f"Adapter refresh per step ({mode})")
    if parts:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return ax


def plot_mismatch(rows, ax=None):
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    steps, mean = _series(rows, "mismatch/mean")
    ax.semilogy(steps, [max(v, 1e-9) for v in mean], "o-", ms=3, label="trainer vs engine |Δ log-prob| (mean)")
    steps_m, mx = _series(rows, "mismatch/max")
    ax.semilogy(steps_m, [max(v, 1e-9) for v in mx], ".:", label="… (max)")
    steps_p, gap = _series(rows, "probe/adapter_gap")
    if gap:
        ax.semilogy(steps_p, [max(v, 1e-9) for v in gap], "s-", ms=3, label="adapter vs base on probe")
    ax.set(xlabel="GRPO step", ylabel="|Δ log-prob| (nats)", title="Is the engine serving the trainer's policy?")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return ax


def save_run_plots(rows, evals, out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fn in (("reward", lambda ax: plot_rewards(rows, evals, ax)), ("refresh", lambda ax: plot_refresh(rows, ax)),
                     ("mismatch", lambda ax: plot_mismatch(rows, ax))):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        fn(ax)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
