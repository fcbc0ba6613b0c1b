"""Figures shared by the CLI, the notebooks and the tests. Each function draws into a given Axes
(or makes a Figure) from plain rows, so a notebook can redraw the same figure live.

Readable at notebook width: every text is at least MIN_FONT_PT (8 pt = 11 px at matplotlib's 100
dpi), legends sit outside the data, and parts that are compared share a linear axis. They are
plain matplotlib figures, shown by whatever PNG formatter the notebook has; each figure a notebook
shows is named by its label (`fig.set_label`).
"""
from __future__ import annotations

import io
import math

import matplotlib.pyplot as plt  # headless: matplotlib picks Agg by itself when there is no display

PART_COLORS = {"write": "#4c72b0", "snapshot": "#8172b2", "stage": "#64b5cd", "unload": "#dd8452",
               "load": "#55a868", "merge": "#937860", "push": "#c44e52", "snapshot & rest": "#8172b2",
               "not split": "#999999", "call": "#5d6d7e", "first request": "#e8a33d"}
PART_ORDER = ["snapshot", "snapshot & rest", "write", "merge", "stage", "unload", "load", "push"]
MIN_FONT_PT = 8.0
STYLE = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "xtick.labelsize": 9,
         "ytick.labelsize": 9, "legend.fontsize": 9, "figure.titlesize": 12, "figure.dpi": 100}


def use_style() -> None:
    """The notebooks' figure style (STYLE: text of 9 pt and more, 100 dpi)."""
    plt.rcParams.update(STYLE)


# --- one run, step by step (the CLI's plots and the step-through panel) --------------------------
def _series(rows, key):
    pts = [(r["step"], r[key]) for r in rows
           if r.get(key) is not None and not (isinstance(r[key], float) and math.isnan(r[key]))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _rolling(values, window=5):
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def title_with_legend(ax, title: str, ncol: int = 3) -> None:
    """A left-aligned title with the legend (if any) between it and the axes, never over the data;
    the title is lifted by the legend's rows."""
    handles = ax.get_legend_handles_labels()[0]
    rows = -(-len(handles) // ncol) if handles else 0
    if handles:
        ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=ncol, frameon=False, borderaxespad=0.2,
                  handlelength=1.6, columnspacing=1.0)
    ax.set_title(title, loc="left", pad=8 + 17 * rows)


def _legend_right(ax) -> None:
    """A one-column legend right of the axes, in the order the parts were drawn."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0.0)


def plot_rewards(rows, evals=(), ax=None):
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    steps, reward = _series(rows, "reward/mean")
    ax.plot(steps, reward, ".", alpha=0.4, color="#4c72b0", label="reward")
    ax.plot(steps, _rolling(reward), "-", color="#4c72b0", label="reward, mean of 5")
    steps_f, fmt = _series(rows, "reward/strict_format")
    ax.plot(steps_f, _rolling(fmt), "--", color="#55a868", label="ends '#### N', mean of 5")
    for e in evals:
        if not e.get("greedy"):
            ax.plot([e["step"]], [e["strict"]], "D", color="#c44e52", ms=7)
    if any(not e.get("greedy") for e in evals):
        ax.plot([], [], "D", color="#c44e52", label="held-out reward")
    ax.set(xlabel="GRPO step", ylabel="mean over the step's completions", ylim=(-0.02, 1.02))
    title_with_legend(ax, "Reward")
    ax.grid(alpha=0.3)
    return ax


def _refresh_parts(rows):
    found = {k[len("refresh/"):-2] for r in rows for k in r
             if k.startswith("refresh/") and k.endswith("_s") and k != "refresh/total_s"}
    return [p for p in PART_ORDER if p in found] + sorted(found - set(PART_ORDER))


def plot_refresh(rows, ax=None):
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    parts = _refresh_parts(rows)
    bottom = [0.0] * len(rows)
    steps = [r["step"] for r in rows]
    for part in parts:
        vals = [1e3 * (r.get(f"refresh/{part}_s") or 0.0) for r in rows]
        ax.bar(steps, vals, bottom=bottom, color=PART_COLORS.get(part), label=part, width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals)]
    mode = rows[0].get("refresh/mode", "") if rows else ""
    ax.set(xlabel="GRPO step", ylabel="ms")
    title_with_legend(ax, f"Adapter refresh after each step ({mode})" if mode else "Adapter refresh after each step",
                      ncol=4)
    ax.grid(alpha=0.3, axis="y")
    return ax


def plot_mismatch(rows, ax=None):
    """Trainer-vs-engine mismatch (mean and p99 over the step's sampled tokens) next to the probe
    gap (adapter vs base on a fixed answer: how far the adapter moved the model); the first must
    stay far below the second."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    for key, style, label in (("probe/adapter_gap", "s-", "probe gap"), ("mismatch/p99", "^:", "mismatch, p99"),
                              ("mismatch/mean", "o-", "mismatch, mean")):
        steps, values = _series(rows, key)
        if values:
            ax.semilogy(steps, [max(v, 1e-9) for v in values], style, ms=3, label=label)
    ax.set(xlabel="GRPO step", ylabel="|Δ log-prob| (nats)")
    title_with_legend(ax, "Is the engine serving the trainer's policy?")
    ax.grid(alpha=0.3)
    return ax


def plot_delta_norm(rows, ax=None):
    """‖ΔW‖ = sqrt(Σ ‖(α/r)·B·A‖²_F) over the adapted layers, per step: 0 until the adapter moves."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    steps, norm = _series(rows, "adapter/delta_norm")
    ax.plot(steps, norm, "o-", ms=3, color="#8172b2")
    ax.set(xlabel="GRPO step", ylabel="‖ΔW‖ (Frobenius)")
    title_with_legend(ax, "How far the adapter has moved: ‖ΔW‖")
    ax.grid(alpha=0.3)
    return ax


def run_plot_images(rows, evals) -> dict[str, bytes]:
    """The run's three figures as PNG bytes (reward, refresh, mismatch), for runlog.RunLog.save_plots."""
    images = {}
    for name, fn in (("reward", lambda ax: plot_rewards(rows, evals, ax)),
                     ("refresh", lambda ax: plot_refresh(rows, ax)), ("mismatch", lambda ax: plot_mismatch(rows, ax))):
        fig, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
        fn(ax)
        buffer = io.BytesIO()
        fig.savefig(buffer, dpi=110, format="png")
        plt.close(fig)
        images[name] = buffer.getvalue()
    return images


# --- refresh methods (notebook 02): rows as refresh_bench.measure_refresh makes them ---------------
def _parts(rows):
    present = {p for r in rows for p in r["parts"]}
    return [p for p in PART_ORDER if p in present] + sorted(present - set(PART_ORDER))


def _floor_ms(row, bandwidth_gbps):
    return 1e3 * row["bytes"] / (bandwidth_gbps * 1e9) if bandwidth_gbps and row.get("bytes") else None


def plot_end_to_end(rows, ax, bandwidth_gbps: float | None = None):
    """One bar per mode, fastest on top: the refresh call, then (where measured) the first request
    after it; the total at the bar's end and, given the bandwidth, each mode's floor as a black tick."""
    rows = sorted(rows, key=lambda r: r["total_s"] + r.get("first_request_s", 0.0))
    ends = []
    for y, row in enumerate(rows):
        call, first = 1e3 * row["total_s"], 1e3 * row.get("first_request_s", 0.0)
        ax.barh(y, call, color=PART_COLORS["call"], label="refresh call" if y == 0 else None)
        if first:
            ax.barh(y, first, left=call, color=PART_COLORS["first request"],
                    label="first request after it" if y == 0 else None)
        ends.append(call + first)
        ax.text(call + first, y, f"  {call + first:.1f} ms", va="center")
        floor = _floor_ms(row, bandwidth_gbps)
        if floor is not None:
            ax.plot([floor, floor], [y - 0.4, y + 0.4], color="k", lw=2, label="floor" if y == 0 else None)
    ax.set_yticks(range(len(rows)), [r.get("label", r["mode"]) for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.3 * max(ends))
    ax.set_xlabel("ms (median)")
    title_with_legend(ax, "End to end, per mode")
    ax.grid(alpha=0.3, axis="x")
    return ax


def plot_parts(rows, ax):
    """The refresh call of each mode split into its parts, stacked on a linear axis (same mode
    order as `plot_end_to_end`); the legend sits right of the axes."""
    rows = sorted(rows, key=lambda r: r["total_s"] + r.get("first_request_s", 0.0))
    left = [0.0] * len(rows)
    for part in _parts(rows):
        vals = [1e3 * r["parts"].get(part, 0.0) for r in rows]
        ax.barh(range(len(rows)), vals, left=left, color=PART_COLORS.get(part), label=part)
        left = [a + v for a, v in zip(left, vals)]
    ax.set_yticks(range(len(rows)), [r.get("label", r["mode"]) for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.05 * max(left))
    ax.set_xlabel("ms (median of each part)")
    ax.set_title("Where the refresh call's time goes", loc="left")
    _legend_right(ax)
    ax.grid(alpha=0.3, axis="x")
    return ax


def refresh_modes_figure(rows, bandwidth_gbps: float | None = None, label: str = ""):
    """Which refresh is fastest end to end (left), and where each call's time goes (right)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 1.6 + 0.55 * len(rows)), layout="constrained")
    fig.set_label("refresh_modes")
    plot_end_to_end(rows, left, bandwidth_gbps)
    plot_parts(rows, right)
    fig.suptitle(label, x=0.01, ha="left")
    return fig


def push_cost_fit(rows) -> tuple[float, float]:
    """Least-squares fit of merged refresh time against the number of pushes (buckets):
    (fixed ms, ms per push)."""
    xs, ys = [r["buckets"] for r in rows], [1e3 * r["total_s"] for r in rows]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var and n > 1 else 0.0
    return my - slope * mx, slope


def merged_buckets_figure(rows, bandwidth_gbps: float | None = None, label: str = ""):
    """Merged refresh vs bucket size (left, log x: the sizes span decades) and vs the number of
    pushes it takes (right, linear: the slope is the cost of one push)."""
    rows = sorted(rows, key=lambda r: r["bucket_mb"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    fig.set_label("merged_buckets")
    ms = [1e3 * r["total_s"] for r in rows]
    left.plot([r["bucket_mb"] for r in rows], ms, "o-", color=PART_COLORS["push"], label="merged refresh")
    for r, y in zip(rows, ms):
        left.annotate(f"{r['buckets']}", (r["bucket_mb"], y), textcoords="offset points", xytext=(0, 6),
                      ha="center", fontsize=9)
    floor = _floor_ms(rows[0], bandwidth_gbps)
    if floor is not None:
        left.axhline(floor, color="k", ls="--", lw=1, label=f"floor: all weights moved once ({floor:.2g} ms)")
    left.set_xscale("log")
    left.set(xlabel="bucket size (MB); number above a point: pushes", ylabel="ms (median)", ylim=(0, 1.2 * max(ms)))
    title_with_legend(left, "Merged refresh vs bucket size", ncol=2)
    fixed, per_push = push_cost_fit(rows)
    pushes = [r["buckets"] for r in rows]
    right.plot(pushes, ms, "o", color=PART_COLORS["push"], label="measured")
    right.plot([0, max(pushes)], [fixed, fixed + per_push * max(pushes)], "k-", lw=1,
               label=f"fit: {fixed:.1f} ms + {per_push:.2f} ms × pushes")
    right.set(xlabel="pushes (buckets)", ylabel="ms (median)", xlim=(0, 1.05 * max(pushes)), ylim=(0, 1.2 * max(ms)))
    title_with_legend(right, "The same points vs pushes: each push costs the slope", ncol=2)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(label, x=0.01, ha="left")
    return fig


# --- notebook 01: the empty panel, what the run learned, a broken refresh ------------------------------
def empty_axes(ax, note: str) -> None:
    """An axes with no data yet: no ticks (matplotlib would invent a range such as -0.05..0.05) and a
    note in the middle; the title and axis labels stay, so the panel keeps its layout."""
    ax.set_xticks([])
    ax.set_yticks([])
    ax.minorticks_off()
    ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", color="#666666")


def _evals_at(evals, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the greedy held-out evaluations' `key`."""
    greedy = [e for e in evals if e.get("greedy")]
    return [e["step"] for e in greedy], [e[key] for e in greedy]


def plot_learned(rows, evals, ax) -> None:
    """The reward beside what it does not pay for: per step (fresh problems each step, so each point
    is measured on problems the policy has not trained on) the reward, the share ending '#### N' and
    the share whose last number is right in any format, 5-step means; held-out greedy points."""
    for key, color, label in (("reward/mean", "#4c72b0", "reward"),
                              ("reward/strict_format", "#55a868", "ends '#### N'"),
                              ("completions/last_number_right", "#c44e52", "last number right, any format")):
        steps, values = _series(rows, key)
        ax.plot(steps, _rolling(values), "-", color=color, label=f"{label}, mean of 5")
    for key, color, marker in (("format", "#55a868", "s"), ("flexible", "#c44e52", "D")):
        steps, values = _evals_at(evals, key)
        ax.plot(steps, values, marker, color=color, ms=7, ls="none", markeredgecolor="k")
    ax.plot([], [], "s", color="#cccccc", markeredgecolor="k", label="held-out, greedy (same colours)")
    top = max([1.0] + [v for v in _series(rows, "reward/mean")[1]])   # a format bonus pays above 1
    ax.set(xlabel="GRPO step", ylabel="share of completions (reward: mean)", ylim=(-0.02, top + 0.02))
    ax.grid(alpha=0.3)
    title_with_legend(ax, "What the reward paid for, and the arithmetic", ncol=2)


def run_learned_figure(rows, evals):
    """Three questions about a run, side by side: what it learned (`plot_learned`), how far the policy
    moved from the base model (KL, k3 on the sampled tokens) and how sure it became (the entropy of
    its next-token distribution); one point per step each."""
    fig, (learned, kl, entropy) = plt.subplots(1, 3, figsize=(13, 4.6), layout="constrained",
                                               gridspec_kw={"width_ratios": [1.5, 1, 1]})
    fig.set_label("run_learned")
    plot_learned(rows, evals, learned)
    for ax, key, color, title, ylabel in (
            (kl, "kl/mean", "#8172b2", "KL to the base model", "nats per token (k3)"),
            (entropy, "entropy/mean", "#937860", "Entropy of the policy", "nats per token")):
        steps, values = _series(rows, key)
        ax.plot(steps, values, "o-", ms=3, color=color)
        ax.set(xlabel="GRPO step", ylabel=ylabel, ylim=(0, 1.15 * max(values, default=0) or 1))
        ax.grid(alpha=0.3)
        ax.set_title(title, loc="left")
    return fig


def broken_refresh_figure(refreshed, broken, mode: str = "none"):
    """The same steps with the engine refreshed (the run above) and with refresh.mode=`mode`: the
    trainer-vs-engine mismatch beside the refreshed run's probe gap (left, log scale: they differ by
    decades), and the reward the engine's completions earned (right)."""
    fig, (gap, reward) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    fig.set_label("broken_refresh")
    for rows, key, style, color, label in (
            (refreshed, "probe/adapter_gap", "s-", "#999999", "probe gap, refreshed run"),
            (refreshed, "mismatch/mean", "o-", "#4c72b0", "mismatch, refreshed run"),
            (broken, "mismatch/mean", "o-", "#c44e52", f"mismatch, refresh.mode={mode}")):
        steps, values = _series(rows, key)
        gap.semilogy(steps, [max(v, 1e-9) for v in values], style, ms=4, color=color, label=label)
    gap.set(xlabel="GRPO step", ylabel="|Δ log-prob| (nats)")
    gap.grid(alpha=0.3)
    title_with_legend(gap, "Trainer vs engine", ncol=1)
    for rows, color, label in ((refreshed, "#4c72b0", "refreshed run"), (broken, "#c44e52", f"refresh.mode={mode}")):
        steps, values = _series(rows, "reward/mean")
        reward.plot(steps, values, "o-", ms=4, color=color, label=label)
    top = max([1.0] + [v for rows in (refreshed, broken) for v in _series(rows, "reward/mean")[1]])
    reward.set(xlabel="GRPO step", ylabel="reward (mean over the step)", ylim=(-0.02, top + 0.02))
    reward.grid(alpha=0.3)
    title_with_legend(reward, "Reward of the engine's completions", ncol=2)
    for ax in (gap, reward):
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    return fig
