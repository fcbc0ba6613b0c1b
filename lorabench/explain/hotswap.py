"""Notebook 03: ΔW beside W and ΔW's singular values (the cliff at r), long waits shown as they go, and a
trained run's adapter reused (or trained here when there is none)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..metrics import REWARD, STRICT_FORMAT
from ..progress import WaitProgress
from ..viz import label_axes, labelled_figure

RANK_TOL = 1e-5   # σ_i / σ_1 below this is float32 rounding of B·A, not a direction ΔW has


@torch.no_grad()
def delta_w_spectrum(f: dict) -> dict:
    """Singular values of ΔW and W (float64), r, ΔW's numerical rank and the cliff: σ_{r+1}/σ_r, σ_{r+1}/σ_1."""
    r = f["A"].shape[0]
    s_delta, s_w = (torch.linalg.svdvals(f[key].double()) for key in ("delta", "W"))
    first = float(s_delta[0]) or 1.0
    after = float(s_delta[r]) if len(s_delta) > r else 0.0
    return {"r": r, "delta": s_delta, "W": s_w, "rank": int((s_delta > RANK_TOL * first).sum()),
            "cliff": after / (float(s_delta[r - 1]) or 1.0), "after_r_vs_first": after / first}


def plot_delta_w(f: dict):
    """W and ΔW on ONE colour scale (W's), so their sizes compare, and ΔW magnified on its own."""
    w_lim = float(f["W"].abs().max()) or 1.0
    d_lim = float(f["delta"].abs().max()) or w_lim
    zoom = w_lim / d_lim
    fig, axes = labelled_figure("delta_w", 1, 3, figsize=(13, 4.0))
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
    """ΔW's and W's singular values on a log axis, r marked: ΔW's fall off a cliff after r, W's not."""
    r = spectrum["r"]
    fig, ax = labelled_figure("delta_w_singular_values", figsize=(9, 3.8))
    tiny = torch.finfo(torch.float64).tiny   # a zero singular value has no place on a log axis
    for key, color, label in (("W", "#999999", "W (frozen)"), ("delta", "#4c72b0", "ΔW")):
        s = spectrum[key].clamp_min(tiny)
        ax.plot(range(1, len(s) + 1), s.numpy(), ".-", color=color, ms=4, lw=1, label=label)
    ax.axvline(r + 0.5, color="#c44e52", ls="--", lw=1, label=f"after index r = {r}")
    label_axes(ax, f"Singular values{f' of {module}' if module else ''}: σ_{r + 1}/σ_{r} = {spectrum['cliff']:.1g} "
                   f"for ΔW", ncol=3, which="both", xlabel="index i (largest first)", ylabel="singular value σ_i",
               yscale="log")
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


def resolve_model_shown(model, warmstart, seed: int) -> tuple[str, bool, float]:
    """(path, built now?, seconds): the base model's path as session.resolve_model resolves it, with a progress
    bar when the tiny model must first be built and warm-started."""
    from ..models import model_ref, resolve_model_path
    from ..tiny import tiny_cache_path
    t0 = time.perf_counter()
    if model_ref(model).kind != "tiny" or (tiny_cache_path(model.cache_dir, warmstart, seed) / "config.json").is_file():
        return resolve_model_path(model, warmstart, seed, log=lambda *a: None), False, time.perf_counter() - t0
    what = "building and warm-starting the tiny model (cached afterwards)"
    with WaitProgress(what) as progress:
        progress(what, 0, warmstart.steps)
        path = resolve_model_path(model, warmstart, seed, log=lambda *a: None,
                                  progress=lambda _, done, total: progress(what, done, total))
    return path, True, time.perf_counter() - t0


def last_mean(rows: list[dict], key: str = REWARD, last: int = 5) -> float:
    return sum(r[key] for r in rows[-last:]) / len(rows[-last:])


def use_trained_run(trainer, found: tuple, run_root: str | Path, steps: int) -> str:
    """Load the run `found` (session.reuse.find_trained_run's) into `trainer`, or with none train `steps` steps
    here; Markdown that says which happened."""
    from ..session.reuse import load_trained_run
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
        with WaitProgress(what := "GRPO steps") as progress:   # trained here, a progress bar
            progress(what, 0, steps)
            for i in range(steps):
                t0 = time.perf_counter()
                m = trainer.step().metrics
                progress(what, i + 1, steps, note=f"reward {m[REWARD]:.2f}, last step "
                                                  f"{time.perf_counter() - t0:.1f} s")
            seconds = progress.finish(f"reward of the last step {trainer.history[-1][REWARD]:.2f}")
        text = (f"**Trained here:** no run dir of this experiment with a checkpoint under `{run_root}` (notebook 01 "
                f"and `lorabench demo` write there), so this kernel trained {steps} GRPO steps in {seconds:.0f} s, "
                f"writing nothing to disk.{skipped}")
    rows = trainer.history
    if rows:
        k = min(5, len(rows))
        text += (f"\n\nIts reward: {last_mean(rows[:k]):.2f} over the first {k} steps, {last_mean(rows, last=k):.2f} "
                 f"over the last {k}; answers ending '#### N': {last_mean(rows[:k], STRICT_FORMAT):.0%} "
                 f"→ {last_mean(rows, STRICT_FORMAT, k):.0%}.")
    return text
