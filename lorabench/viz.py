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


def plot_delta_norm(rows, ax=None):
    """‖ΔW‖ = sqrt(Σ ‖(α/r)·B·A‖²_F) over the adapted layers, per step: 0 until the adapter moves."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    steps, norm = _series(rows, "adapter/delta_norm")
    ax.plot(steps, norm, "o-", ms=3, color="#8172b2")
    ax.set(xlabel="GRPO step", ylabel="‖ΔW‖ (Frobenius)", title="Adapter weight norm")
    ax.grid(alpha=0.3)
    return ax


# --- refresh latency sweeps (refresh_bench.py rows) ---------------------------------------------
PART_ORDER = ["snapshot", "write", "merge", "stage", "unload", "load", "push"]


def _parts(rows):
    present = {p for r in rows for p in r["parts"]}
    return [p for p in PART_ORDER if p in present] + sorted(present - set(PART_ORDER))


def plot_refresh_sweep(rows, mode: str, rank: int | None = None, bandwidth_gbps: float | None = None, ax=None):
    """Latency vs bucket size (log x, log y) for one mode and rank: the parts stacked as bars, and
    the floor (bytes / bandwidth) as a dashed line. On a log y axis the segments' heights are not
    proportional to their share; the bar tops (the totals) and the floor are exact."""
    ax = ax or plt.subplots(figsize=(5, 3.5))[1]
    sel = sorted((r for r in rows if r["mode"] == mode and (rank is None or r["rank"] == rank)),
                 key=lambda r: r["bucket_mb"])
    if not sel:
        ax.set_axis_off()
        return ax
    x = [r["bucket_mb"] for r in sel]
    left, width = [v / 1.3 for v in x], [v * 1.3 - v / 1.3 for v in x]   # bars of equal width on log x
    bottom = [0.0] * len(sel)
    for part in _parts(sel):
        vals = [1e3 * r["parts"].get(part, 0.0) for r in sel]
        ax.bar(left, vals, width=width, bottom=bottom, align="edge", color=PART_COLORS.get(part), label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    nbytes = sel[0]["bytes"]
    if bandwidth_gbps:
        floor_ms = 1e3 * nbytes / (bandwidth_gbps * 1e9)
        ax.axhline(floor_ms, color="k", ls="--", lw=1, label=f"floor {floor_ms:.2g} ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="bucket size (MB)", ylabel="ms",
           title=f"{mode}" + (f", r={rank}" if rank is not None else "") + f" ({nbytes / 2**20:.2f} MB)")
    ax.legend(fontsize=6, loc="upper right")
    ax.grid(alpha=0.3, which="both")
    return ax


def refresh_sweep_figure(rows, bandwidth_gbps: float | None = None, label: str = ""):
    """One panel per (rank, mode): rows are ranks, columns are modes. `label` heads the figure
    (say which engine and device: "hf engine, CPU (not SGLang)")."""
    modes = [m for m in ("file", "tensor", "merged") if any(r["mode"] == m for r in rows)]
    modes += sorted({r["mode"] for r in rows} - set(modes))
    ranks = sorted({r["rank"] for r in rows})
    fig, axes = plt.subplots(len(ranks), len(modes), figsize=(4.2 * len(modes), 3.2 * len(ranks)),
                             squeeze=False, sharey=True)
    for i, rank in enumerate(ranks):
        for j, mode in enumerate(modes):
            plot_refresh_sweep(rows, mode, rank, bandwidth_gbps, axes[i][j])
    floor = f"; floor = bytes / {bandwidth_gbps:.1f} GB/s (measured copy)" if bandwidth_gbps else ""
    fig.suptitle(f"Refresh latency per bucket size: {label}{floor}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_refresh_summary(summary, ax=None, bandwidth_gbps: float | None = None):
    """Median refresh per (source, mode) as horizontal stacked bars (refresh_bench.gpu_refresh_summary)."""
    ax = ax or plt.subplots(figsize=(7, 0.5 + 0.45 * len(summary)))[1]
    labels = [f"{s['source']} · {s['mode']} ({s['bytes'] / 2**20:.1f} MB)" for s in summary]
    left = [0.0] * len(summary)
    for part in _parts(summary):
        vals = [1e3 * s["parts"].get(part, 0.0) for s in summary]
        ax.barh(range(len(summary)), vals, left=left, color=PART_COLORS.get(part), label=part)
        left = [a + v for a, v in zip(left, vals)]
    if bandwidth_gbps:
        floors = [1e3 * s["bytes"] / (bandwidth_gbps * 1e9) for s in summary]
        ax.plot(floors, range(len(summary)), "k|", ms=14, label="floor")
    ax.set_yticks(range(len(summary)), labels, fontsize=7)
    ax.set(xlabel="ms (median over steps)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    return ax
