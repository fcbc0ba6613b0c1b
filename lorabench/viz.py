"""Figures shared by the CLI, the notebooks and the tests, drawn from plain rows (so a notebook can
redraw them live). Readable at notebook width: every text is at least MIN_FONT_PT, legends sit outside
the data, compared parts share a linear axis; each figure a notebook shows is named (`fig.set_label`).
"""
from __future__ import annotations

import io
import itertools
import math
import statistics

import matplotlib.pyplot as plt  # headless: matplotlib picks Agg by itself when there is no display
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from . import metrics as m

PART_COLORS = {"write": "#4c72b0", "snapshot": "#8172b2", "stage": "#64b5cd", "unload": "#dd8452",
               "load": "#55a868", "merge": "#937860", "push": "#c44e52", "snapshot & rest": "#8172b2",
               "not split": "#999999", "call": "#5d6d7e", "first request": "#e8a33d"}
PART_ORDER = ["snapshot", "snapshot & rest", "write", "merge", "stage", "unload", "load", "push"]
MIN_FONT_PT = 8.0
STYLE = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "xtick.labelsize": 9,
         "ytick.labelsize": 9, "legend.fontsize": 9, "figure.titlesize": 12, "figure.dpi": 100}


def labelled_figure(label: str, *grid, title: str | None = None, **kw):
    """plt.subplots(*grid, layout="constrained", **kw), the figure named `label`, `title` its left suptitle."""
    fig, axes = plt.subplots(*grid, layout="constrained", **kw)
    fig.set_label(label)
    if title is not None:
        fig.suptitle(title, x=0.01, ha="left")
    return fig, axes


def in_part_order(found) -> list[str]:
    """Refresh part names in PART_ORDER, then any others alphabetically."""
    return [p for p in PART_ORDER if p in found] + sorted(set(found) - set(PART_ORDER))


def _series(rows, key):
    pts = [(r["step"], r[key]) for r in rows
           if r.get(key) is not None and not (isinstance(r[key], float) and math.isnan(r[key]))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _rolling(values, window=5):
    return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def _plot_key(ax, rows, key, fmt, log: bool = False, rolling: bool = False, **kw) -> list:
    """`key` against the step (`rolling`: its 5-step mean; `log`: floored at 1e-9); returns the values."""
    steps, values = _series(rows, key)
    values = _rolling(values) if rolling else values
    if log:
        ax.semilogy(steps, [max(v, 1e-9) for v in values], fmt, **kw)
    else:
        ax.plot(steps, values, fmt, **kw)
    return values


def title_with_legend(ax, title: str, ncol: int = 3) -> None:
    """A left-aligned title, lifted by the legend's rows, with the legend between it and the axes."""
    handles = ax.get_legend_handles_labels()[0]
    rows = -(-len(handles) // ncol) if handles else 0
    if handles:
        ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=ncol, frameon=False, borderaxespad=0.2,
                  handlelength=1.6, columnspacing=1.0)
    ax.set_title(title, loc="left", pad=8 + 17 * rows)


def label_axes(ax, title: str, ncol: int = 3, axis: str = "both", which: str = "major", **props):
    """ax.set(**props), `title_with_legend`, and a light grid along `axis` at `which` ticks; returns ax."""
    ax.set(**props)
    title_with_legend(ax, title, ncol)
    ax.grid(alpha=0.3, axis=axis, which=which)
    return ax


def plot_rewards(rows, evals=(), ax=None):
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    _plot_key(ax, rows, m.REWARD, ".", alpha=0.4, color="#4c72b0", label="reward")
    _plot_key(ax, rows, m.REWARD, "-", rolling=True, color="#4c72b0", label="reward, mean of 5")
    _plot_key(ax, rows, m.STRICT_FORMAT, "--", rolling=True, color="#55a868", label="ends '#### N', mean of 5")
    if sampled := [e for e in evals if not e.get(m.HELD_GREEDY)]:
        ax.plot([e["step"] for e in sampled], [e[m.HELD_STRICT] for e in sampled], "D", color="#c44e52", ms=7,
                label="held-out reward")
    return label_axes(ax, "Reward", xlabel="GRPO step", ylabel="mean over the step's completions", ylim=(-0.02, 1.02))


def plot_refresh(rows, ax=None):
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    parts = in_part_order(m.refresh_parts(rows))
    bottom = [0.0] * len(rows)
    steps = [r["step"] for r in rows]
    for part in parts:
        vals = [1e3 * (r.get(m.refresh_part(part)) or 0.0) for r in rows]
        ax.bar(steps, vals, bottom=bottom, color=PART_COLORS.get(part), label=part, width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals)]
    mode = rows[0].get(m.REFRESH_MODE, "") if rows else ""
    return label_axes(ax, "Adapter refresh after each step" + (f" ({mode})" if mode else ""), ncol=4, axis="y",
                      xlabel="GRPO step", ylabel="ms")


def plot_mismatch(rows, ax=None):
    """Trainer-vs-engine mismatch (mean, p99), which must stay far below the probe gap; steps sampled one
    adapter behind (grpo.max_staleness) drawn apart, as their mismatch is the lag, not the engine's."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    on_policy, behind = [r for r in rows if not r.get(m.LAG)], [r for r in rows if r.get(m.LAG)]
    for part, key, style, label in ((rows, m.PROBE_GAP, "s-", "probe gap"),
                                    (on_policy, m.MISMATCH_P99, "^:", "mismatch, p99"),
                                    (on_policy, m.MISMATCH, "o-", "mismatch, mean"),
                                    (behind, m.MISMATCH, "x", "mean, one behind (lag)")):
        if _series(part, key)[1]:
            _plot_key(ax, part, key, style, log=True, ms=3, label=label,
                      **({"color": "#999999"} if part is behind else {}))
    return label_axes(ax, "Is the engine serving the trainer's policy?", xlabel="GRPO step",
                      ylabel="|Δ log-prob| (nats)")


def plot_delta_norm(rows, ax=None):
    """‖ΔW‖ = sqrt(Σ ‖(α/r)·B·A‖²_F) over the adapted layers, per step: 0 until the adapter moves."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    _plot_key(ax, rows, m.DELTA_NORM, "o-", ms=3, color="#8172b2")
    return label_axes(ax, "How far the adapter has moved: ‖ΔW‖", xlabel="GRPO step", ylabel="‖ΔW‖ (Frobenius)")


RUN_VIEWS = (plot_rewards, plot_refresh, plot_mismatch, plot_delta_norm)   # the step panel's four axes
POLICY_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c"]
GROUP_VIEWS = ((m.REWARD, "Reward (mean of 5 steps)", "mean over the step's completions", False, True),
               (m.MISMATCH, "Mismatch, trainer vs engine", "mean |Δ log-prob| (nats)", True, False),
               (m.REFRESH_S, "Adapter refresh after each step", "s", False, False),
               (m.DELTA_NORM, "How far each adapter has moved: ‖ΔW‖", "‖ΔW‖ (Frobenius)", False, False))


def plot_policies(histories: dict[str, list[dict]], key: str, title: str, ylabel: str, ax=None, log: bool = False,
                  rolling: bool = False):
    """One line per policy of `key` against the step (`histories`: name -> metrics rows)."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    for (name, rows), color in zip(histories.items(), itertools.cycle(POLICY_COLORS)):
        if not _series(rows, key)[1]:
            continue
        if rolling:
            _plot_key(ax, rows, key, ".", alpha=0.3, color=color)
        _plot_key(ax, rows, key, "-", log=log, rolling=rolling, color=color, label=name)
    return label_axes(ax, title, ncol=4, xlabel="GRPO step", ylabel=ylabel)


def run_plot_images(rows, evals) -> dict[str, bytes]:
    """The run's reward, refresh and mismatch figures as PNG bytes, for runlog.RunLog.save_plots."""
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


# --- refresh methods (notebook 02): rows as refresh_bench.measure_refresh makes them
MODE_COLORS = {"file": "#4c72b0", "tensor": "#55a868", "inplace": "#c44e52", "merged": "#8172b2"}


def _floor_ms(row, bandwidth_gbps):
    return 1e3 * row["bytes"] / (bandwidth_gbps * 1e9) if bandwidth_gbps and row.get("bytes") else None


def _repeats_ms(samples, median_s: float) -> list[float]:
    return [1e3 * s for s in (samples if samples is not None else [median_s])]


def end_to_end_ms(row) -> list[float]:
    """Every repeat's refresh call + first request after it, in ms (a row without samples: its medians)."""
    return _repeats_ms(row.get("samples", {}).get("end_to_end_s"), row["total_s"] + row.get("first_request_s", 0.0))


def quartiles(values) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile); one value is all three."""
    values = sorted(values)
    return (values[0],) * 3 if len(values) == 1 else tuple(statistics.quantiles(values, n=4, method="inclusive"))


def median_ms(row) -> float:
    """A refresh row's median end-to-end time in ms (what the figures and the lesson order the modes by)."""
    return quartiles(end_to_end_ms(row))[1]


def plot_spread(ax, at: float, values, color: str, horizontal: bool = True, width: float = 0.5,
                log_position: bool = False) -> tuple:
    """One point per repeat (spread across `width` around `at`, in octaves if `log_position`), the
    interquartile range as a thick bar, the median as a black tick; returns the quartiles."""
    n = len(values)
    offsets = [width * (i / (n - 1) - 0.5) if n > 1 else 0.0 for i in range(n)]
    spots = [at * 2 ** o if log_position else at + o for o in offsets]
    q1, median, q3 = quartiles(values)
    xy = (lambda v, p: (v, p)) if horizontal else (lambda v, p: (p, v))   # (values, positions) as (x, y)
    ax.plot(*xy(values, spots), "o", ms=4, color=color, alpha=0.55, mec="none")
    ax.plot(*xy([q1, q3], [at, at]), "-", lw=6, color=color, alpha=0.45, solid_capstyle="butt")
    ax.plot(*xy([median], [at]), "|" if horizontal else "_", ms=14, mew=2.5, color="k")
    return q1, median, q3


def _spread_legend(ax, color="#777777", floor: bool = False, vertical_tick: bool = True) -> None:
    ax.plot([], [], "o", ms=4, color=color, alpha=0.55, mec="none", label="each repeat")
    ax.plot([], [], "-", lw=6, color=color, alpha=0.45, label="middle half (IQR)")
    ax.plot([], [], "|" if vertical_tick else "_", ms=10, mew=2.5, color="k", label="median")
    if floor:
        ax.plot([], [], "D", ms=6, color="k", mfc="white", label="floor: bytes moved once")


def _spread_rows(ax, rows, labels, note, color=lambda row: "#5d6d7e", floors=()) -> tuple[float, float]:
    """One `plot_spread` per row (end to end, top down, log x) labelled `note(median, values)`, a diamond at
    each floor (ms) not None; returns (lowest repeat or floor, highest repeat)."""
    every = [end_to_end_ms(row) for row in rows]
    for y, (row, values) in enumerate(zip(rows, every)):
        _, median, _ = plot_spread(ax, y, values, color(row))
        ax.annotate(note(median, values), (max(values), y), textcoords="offset points", xytext=(6, 0), va="center")
    floors = [(y, floor) for y, floor in enumerate(floors) if floor is not None]
    for y, floor in floors:
        ax.plot([floor], [y], "D", ms=6, color="k", mfc="white")
    ax.set_yticks(range(len(rows)), labels)
    ax.set(ylim=(len(rows) - 0.5, -0.5), xscale="log")
    ax.grid(alpha=0.3, axis="x", which="both")
    return min([min(v) for v in every] + [f for _, f in floors]), max(max(v) for v in every)


def refresh_modes_figure(rows, bandwidth_gbps: float | None = None, label: str = ""):
    """Each mode's refreshes end to end (call + first request) with every repeat, on a log x beside the floor
    (left), and its median call split into its parts, then the median first request, stacked linearly (right);
    fastest median on top."""
    rows = sorted(rows, key=median_ms)
    fig, (ax, parts) = labelled_figure("refresh_modes", 1, 2, figsize=(12, 2.2 + 0.6 * len(rows)), title=label)
    labels = [r.get("label", r["mode"]) for r in rows]
    lowest, highest = _spread_rows(ax, rows, labels, lambda median, _: f"{ms_text(median)} ms",
                                   lambda row: MODE_COLORS.get(row["mode"], "#5d6d7e"),
                                   [_floor_ms(row, bandwidth_gbps) for row in rows])
    _spread_legend(ax, floor=bandwidth_gbps is not None)
    ax.set(xlabel="ms, refresh call + first request (log scale)", xlim=(lowest / 2, 4 * highest))
    title_with_legend(ax, "End to end, per mode", ncol=4)
    left = [0.0] * len(rows)
    for part in [*in_part_order({p for r in rows for p in r["parts"]}), "first request"]:
        vals = [1e3 * (r.get("first_request_s", 0.0) if part == "first request" else r["parts"].get(part, 0.0))
                for r in rows]
        parts.barh(range(len(rows)), vals, left=left, color=PART_COLORS.get(part), label=part)
        left = [a + v for a, v in zip(left, vals)]
    parts.set_yticks(range(len(rows)), labels)
    parts.invert_yaxis()
    parts.set(xlim=(0, 1.05 * max(left)), xlabel="ms: the median call's parts, then the median first request")
    parts.set_title("Where the time goes", loc="left")
    parts.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0.0)   # in drawing order
    parts.grid(alpha=0.3, axis="x")
    return fig


def call_ms(row) -> list[float]:
    """Every repeat's refresh call in ms (a row without samples: its median)."""
    return _repeats_ms(row.get("samples", {}).get("total_s"), row["total_s"])


def part_ms(row, part: str) -> list[float]:
    """Every repeat's time in one part of the call, in ms (a row without samples: the median's)."""
    return _repeats_ms(row.get("samples", {}).get("parts", {}).get(part), row["parts"].get(part, 0.0))


def push_cost_fit(rows) -> tuple[float, float]:
    """Least squares of the median push part against pushes: (fixed ms, ms per push)."""
    xs, ys = [r["buckets"] for r in rows], [quartiles(part_ms(r, "push"))[1] for r in rows]
    if len(set(xs)) < 2:   # one push count: no slope to fit
        return statistics.fmean(ys), 0.0
    slope, fixed = statistics.linear_regression(xs, ys)
    return fixed, slope


def merged_buckets_figure(rows, curve, bandwidth_gbps: float | None = None, label: str = ""):
    """The pushes each bucket size takes (left); each merged refresh's push part against its pushes, with
    the fitted line (its slope: one push's cost) and the floor (right)."""
    rows = sorted(rows, key=lambda r: r["buckets"])
    fig, (left, right) = labelled_figure("merged_buckets", 1, 2, figsize=(12, 4.4), title=label)
    left.step([mb for mb, _ in curve], [n for _, n in curve], where="post", color="#999999",
              label="pushes the packing gives")
    left.plot([r["bucket_mb"] for r in rows], [r["buckets"] for r in rows], "o", ms=7, color=PART_COLORS["push"],
              label="bucket sizes measured")
    for r in rows:
        left.annotate(f"{r['bucket_mb']:g} MB", (r["bucket_mb"], r["buckets"]), textcoords="offset points",
                      xytext=(6, 4))
    label_axes(left, "Bucket size -> pushes, from the tensors' sizes", ncol=1, which="both", xscale="log",
               yscale="log", xlabel="bucket size (MB, log scale)", ylabel="pushes (engine calls, log scale)")
    for r in rows:
        plot_spread(right, r["buckets"], part_ms(r, "push"), PART_COLORS["push"], horizontal=False)
    _spread_legend(right, PART_COLORS["push"], vertical_tick=False)
    fixed, per_push = push_cost_fit(rows)
    most = max(r["buckets"] for r in rows)
    right.plot([0, most], [fixed, fixed + per_push * most], "k:", lw=1,
               label=f"line: {fixed:.3g} ms {'+' if per_push >= 0 else '−'} {abs(per_push):.2g} ms × pushes")
    floor = _floor_ms(rows[0], bandwidth_gbps)
    if floor is not None:
        right.axhline(floor, color="k", ls="--", lw=1.2, label=f"floor: weights moved once ({floor:.2g} ms)")
    top = max(max(part_ms(r, "push")) for r in rows)
    label_axes(right, "The push part of a merged refresh vs pushes", ncol=2, which="both",
               xlabel="pushes (engine calls)", ylabel="ms, the call's push part", xlim=(0, 1.08 * most),
               ylim=(0, 1.15 * max(top, floor or 0.0)))
    return fig


def run_learned_figure(rows, evals):
    """What a run learned (5-step means of the reward, the share ending '#### N' and of right last numbers;
    held-out greedy points), its KL to the base model and its entropy, per step."""
    fig, (ax, kl, entropy) = labelled_figure("run_learned", 1, 3, figsize=(13, 4.6),
                                             gridspec_kw={"width_ratios": [1.5, 1, 1]})
    for key, color, label in ((m.REWARD, "#4c72b0", "reward"), (m.STRICT_FORMAT, "#55a868", "ends '#### N'"),
                              (m.LAST_NUMBER_RIGHT, "#c44e52", "last number right, any format")):
        _plot_key(ax, rows, key, "-", rolling=True, color=color, label=f"{label}, mean of 5")
    greedy = [e for e in evals if e.get(m.HELD_GREEDY)]
    for key, color, marker in ((m.HELD_FORMAT, "#55a868", "s"), (m.HELD_FLEXIBLE, "#c44e52", "D")):
        ax.plot([e["step"] for e in greedy], [e[key] for e in greedy], marker, color=color, ms=7, ls="none",
                markeredgecolor="k")
    ax.plot([], [], "s", color="#cccccc", markeredgecolor="k", label="held-out, greedy (same colours)")
    label_axes(ax, "What the reward paid for, and the arithmetic", ncol=2, xlabel="GRPO step",
               ylabel="share of completions (reward: mean)", ylim=(-0.02, _top_reward(rows) + 0.02))
    for ax, key, color, title, ylabel in (
            (kl, m.KL, "#8172b2", "KL to the base model", "nats per token (k3)"),
            (entropy, m.ENTROPY, "#937860", "Entropy of the policy", "nats per token")):
        values = _plot_key(ax, rows, key, "o-", ms=3, color=color)
        label_axes(ax, title, xlabel="GRPO step", ylabel=ylabel, ylim=(0, 1.15 * max(values, default=0) or 1))
    return fig


def _top_reward(*histories) -> float:
    """The highest reward in `histories`, at least 1 (a format bonus pays above 1)."""
    return max([1.0] + [v for rows in histories for v in _series(rows, m.REWARD)[1]])


def broken_refresh_figure(refreshed, broken, mode: str = "none"):
    """The same steps refreshed and with refresh.mode=`mode`: mismatch and probe gap (left), reward (right)."""
    fig, (gap, reward) = labelled_figure("broken_refresh", 1, 2, figsize=(12, 4.2))
    for rows, key, style, color, label in (
            (refreshed, m.PROBE_GAP, "s-", "#999999", "probe gap, refreshed run"),
            (refreshed, m.MISMATCH, "o-", "#4c72b0", "mismatch, refreshed run"),
            (broken, m.MISMATCH, "o-", "#c44e52", f"mismatch, refresh.mode={mode}")):
        _plot_key(gap, rows, key, style, log=True, ms=4, color=color, label=label)
    label_axes(gap, "Trainer vs engine", ncol=1, xlabel="GRPO step", ylabel="|Δ log-prob| (nats)")
    for rows, color, label in ((refreshed, "#4c72b0", "refreshed run"), (broken, "#c44e52", f"refresh.mode={mode}")):
        _plot_key(reward, rows, m.REWARD, "o-", ms=4, color=color, label=label)
    label_axes(reward, "Reward of the engine's completions", ncol=2, xlabel="GRPO step",
               ylabel="reward (mean over the step)", ylim=(-0.02, _top_reward(refreshed, broken) + 0.02))
    for ax in (gap, reward):
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    return fig


def refresh_rank_figure(rows, label: str = ""):
    """Each mode's refresh end to end against the LoRA rank (log-log), medians joined."""
    fig, ax = labelled_figure("refresh_rank", figsize=(9, 4.6), title=label)
    ranks = sorted({r["rank"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for i, mode in enumerate(modes):
        sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["rank"])
        color = MODE_COLORS.get(mode, "#5d6d7e")
        shift = 2 ** (0.15 * (i - (len(modes) - 1) / 2))   # the modes side by side at each rank
        medians = [plot_spread(ax, r["rank"] * shift, end_to_end_ms(r), color, horizontal=False, width=0.12,
                               log_position=True)[1] for r in sel]
        ax.plot([r["rank"] * shift for r in sel], medians, "-", color=color, lw=1.8, label=mode)
    adapter_mb = {r["rank"]: r["bytes"] / 2**20 for r in rows if r["mode"] == "tensor"}
    if len(adapter_mb) > 1:   # the reference: a time in proportion to the adapter's bytes (slope 1 here)
        low = min(adapter_mb)
        start = min(median_ms(r) for r in rows if r["rank"] == low)
        xs = sorted(adapter_mb)
        ax.plot(xs, [start * adapter_mb[k] / adapter_mb[low] for k in xs], "--", color="black", lw=1.2,
                label="∝ adapter bytes")
    ax.set(xscale="log", yscale="log")
    ax.set_xticks(ranks, [f"{k}\n{adapter_mb[k]:.2g} MB" if k in adapter_mb else f"{k}" for k in ranks])
    ax.minorticks_off()
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))   # 1, 2, 5 of each decade, as numbers
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    label_axes(ax, "Refresh end to end vs LoRA rank: medians joined (bars: middle half; dots: each repeat; "
                   "dashed: a time in proportion to the bytes)", ncol=5, which="both",
               xlabel="LoRA rank (and the adapter's size)", ylabel="ms, refresh call + first request (log)")
    return fig


def thread_probe_figure(rows, label: str = ""):
    """The same in-place refresh end to end at each torch thread count (log x: a 100x stall fits)."""
    fig, ax = labelled_figure("timing_threads", figsize=(9, 1.6 + 0.55 * len(rows)), title=label)
    lowest, highest = _spread_rows(
        ax, rows, [f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}" for r in rows],
        lambda median, values: f"median {ms_text(median)} ms, slowest {ms_text(max(values))} ms")
    _spread_legend(ax)
    ax.set(xlabel="ms, in-place refresh + first request (log scale)", xlim=(lowest / 1.5, 12 * highest))
    title_with_legend(ax, "The same refresh at each torch thread count", ncol=3)
    return fig


def ms_text(ms: float, digits: int = 3) -> str:
    """A time in ms for a lesson's text: `digits` significant digits, no exponent (2,820), 0 below a microsecond."""
    if abs(ms) >= 10 ** (digits - 1):
        return f"{ms:,.0f}"
    return "0" if abs(ms) < 1e-3 else f"{ms:.{digits}g}"


def rank_sweep_figure(histories: dict[str, list[dict]], after: dict[str, dict], key: str = m.HELD_STRICT):
    """Notebook 04: each policy's training reward beside its held-out `key` share (± 2 s.e.)."""
    fig, (left, right) = labelled_figure("rank_sweep", 1, 2, figsize=(11, 3.8), width_ratios=(3, 2))
    plot_policies(histories, m.REWARD, "Training reward (mean of 5 steps)", "mean over the step's completions",
                  ax=left, rolling=True)
    names = list(after)
    shares = [after[name][key] for name in names]
    n = after[names[0]][m.HELD_COUNT]
    errors = [2 * (p * (1 - p) / n) ** 0.5 for p in shares]
    right.bar(names, shares, yerr=errors, capsize=4, color=POLICY_COLORS[:len(names)])
    label_axes(right, f"After training ({n} problems, ± 2 s.e.)", axis="y", ylabel=f"held-out {key} reward (greedy)",
               ylim=(0, 1.05), xlabel="policy")
    return fig
