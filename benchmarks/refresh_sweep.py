"""Refresh latency for every (mode, adapter rank, bucket size) on one engine, next to the floor (the
bytes moved once at the measured copy bandwidth): the rows as JSON and one figure, a panel per rank
and mode.

    python benchmarks/refresh_sweep.py [--ranks 4,16] [--buckets 0.01,1,64] [--out DIR] [key=value ...]

The engine and model are the run config's (default: the hf engine and the tiny model; e.g.
engine.backend=sglang model.name_or_path=DIR on a GPU). Each row is
lorabench.refresh_bench.measure_refresh's median of `--repeats` refreshes; writes
DIR/refresh_sweep.json (refresh_bench.save_results' format) and DIR/refresh_sweep.png.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lorabench import refresh_bench as rb  # noqa: E402
from lorabench.viz import PART_COLORS, PART_ORDER  # noqa: E402

BUCKETS_MB = (0.01, 0.03, 0.1, 0.3, 1.0, 4.0, 16.0, 64.0, 512.0)   # log-spaced; the tiny adapter is ~1 MB


def sweep(engine, model_path: str, modes=rb.MODES, ranks=(4, 16, 64), buckets_mb=BUCKETS_MB, repeats: int = 3,
          warmup: int = 1, log=print) -> list[dict]:
    """Every (mode, rank, bucket) combination on `engine`. Merged runs last: it overwrites the
    engine's base weights (timings stay valid; generations from that engine do not)."""
    order = sorted(modes, key=lambda m: m == "merged")
    rows = []
    for rank in ranks:
        model = rb.adapter_model(model_path, rank, device=str(getattr(engine, "device", "cpu")))
        for mode in order:
            for bucket in buckets_mb:
                row = rb.measure_refresh(engine, model, mode, bucket, repeats, warmup)
                rows.append(row)
                log(f"{mode:>6} r={rank:<3} bucket {bucket:>7g} MB: {1e3 * row['total_s']:8.2f} ms "
                    f"({row['bytes'] / 2**20:.2f} MB in {row['buckets']} bucket(s))")
        del model
    return rows


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
    if ax.get_legend_handles_labels()[0]:   # one column right of the axes, in the order drawn
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0.0)
    ax.grid(alpha=0.3, which="both")
    return ax


def refresh_sweep_figure(rows, bandwidth_gbps: float | None = None, label: str = ""):
    """One panel per (rank, mode): rows are ranks, columns are modes. `label` heads the figure
    (say which engine and device: "hf engine, CPU (not SGLang)")."""
    modes = [m for m in ("file", "tensor", "merged") if any(r["mode"] == m for r in rows)]
    modes += sorted({r["mode"] for r in rows} - set(modes))
    ranks = sorted({r["rank"] for r in rows})
    fig, axes = plt.subplots(len(ranks), len(modes), figsize=(4.2 * len(modes), 3.6 * len(ranks)),
                             squeeze=False, sharey=True, layout="constrained")
    for i, rank in enumerate(ranks):
        for j, mode in enumerate(modes):
            plot_refresh_sweep(rows, mode, rank, bandwidth_gbps, axes[i][j])
    floor = f"; floor = bytes / {bandwidth_gbps:.1f} GB/s (measured copy)" if bandwidth_gbps else ""
    fig.suptitle(f"Refresh latency per bucket size: {label}{floor}", fontsize=10)
    return fig


def main(argv=None) -> Path:
    from lorabench.session import Config, resolve_model, start_engine
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="4,16,64")
    parser.add_argument("--buckets", default=",".join(f"{b:g}" for b in BUCKETS_MB), help="MB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("overrides", nargs="*", help="run config overrides, e.g. engine.backend=sglang")
    args = parser.parse_args(argv)
    cfg = Config.load(None, ["warmstart.steps=0", *args.overrides])   # a refresh needs no trained adapter
    model_path = resolve_model(cfg)
    engine = start_engine(cfg, model_path)   # a scratch engine: merged overwrites its base weights
    try:
        label = rb.engine_label(engine)
        rows = sweep(engine, model_path, ranks=[int(r) for r in args.ranks.split(",")],
                     buckets_mb=[float(b) for b in args.buckets.split(",")], repeats=args.repeats)
        bandwidth = rb.measure_bandwidth(str(engine.device))
    finally:
        engine.close()
    out = Path(args.out)
    path = rb.save_results(out / "refresh_sweep.json", rows, bandwidth, engine=label)
    fig = refresh_sweep_figure(rows, bandwidth, label)
    fig.savefig(out / "refresh_sweep.png", dpi=110)
    plt.close(fig)
    print(f"{path} and {out / 'refresh_sweep.png'}")
    return path


if __name__ == "__main__":
    main()
