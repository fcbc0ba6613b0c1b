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
from contextlib import contextmanager
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from matplotlib.ticker import MaxNLocator

from .adapters import base_param_name
from .data import prompt_ids
from .loss import token_logprobs
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


# --- notebook 03: the progress of a long wait -----------------------------------------------------------
class Progress:
    """A progress bar for one long wait of a lesson: done / total, the time so far and the time left
    estimated from the rate so far. It is one display_data output (an HTML <progress> and a text
    line) redrawn in place by its display id, not a widget: a saved notebook keeps its last state,
    and it is never a library's tqdm bar (notebook tests refuse those). Outside IPython it prints."""

    def __init__(self, what: str, total: int, unit: str = "step"):
        self.what, self.total, self.unit = what, max(1, int(total)), unit
        self.done, self.note, self.t0, self.seconds = 0, "", time.perf_counter(), None
        self.handle = _show(self._bundle())

    def update(self, done: int, note: str = "") -> None:
        self.done, self.note = min(int(done), self.total), note
        self._draw()

    def advance(self, n: int = 1, note: str = "") -> None:
        self.update(self.done + n, note)

    def finish(self, note: str = "") -> float:
        """The bar at its end, with the time it took; returns that time in seconds."""
        self.seconds, self.note = time.perf_counter() - self.t0, note
        self.done = self.total
        self._draw()
        return self.seconds

    def text(self) -> str:
        elapsed = time.perf_counter() - self.t0 if self.seconds is None else self.seconds
        head = f"{self.what}: {self.done}/{self.total} {self.unit}s"
        if self.seconds is not None:
            when = f"done in {self.seconds:.0f} s"
        elif self.done:
            when = f"{elapsed:.0f} s so far, about {elapsed / self.done * (self.total - self.done):.0f} s left"
        else:
            when = f"{elapsed:.0f} s so far (an estimate after the first {self.unit})"
        return f"{head}, {when}{f'; {self.note}' if self.note else ''}"

    def _bundle(self) -> dict:
        import html
        return {"text/plain": self.text(),
                "text/html": f"<progress value='{self.done}' max='{self.total}' style='width:14em'></progress> "
                             f"<span style='font-family:monospace'>{html.escape(self.text())}</span>"}

    def _draw(self) -> None:
        _show(self._bundle(), self.handle)


def _show(bundle: dict, handle=None):
    """Show a mime bundle in the notebook, or replace the one `handle` shows; outside IPython,
    print its text. Returns the handle (None outside IPython)."""
    from IPython import get_ipython
    from IPython.display import display
    if get_ipython() is None:
        print(bundle["text/plain"])
        return None
    if handle is None:
        return display(bundle, raw=True, display_id=True)
    handle.update(bundle, raw=True)
    return handle


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
    bar = Progress("building and warm-starting the tiny model (cached afterwards)", warmstart.steps)

    def log(line, *rest):
        found = WARM_START_LINE.search(str(line))
        if found:
            bar.update(int(found.group(1)))
    path = resolve_model_path(model, warmstart, seed, log=log)
    bar.finish()
    return path, True, time.perf_counter() - t0


def train_shown(trainer, steps: int, what: str = "GRPO steps") -> float:
    """`steps` trainer steps with a progress bar (reward and step time as its note); the seconds taken."""
    bar = Progress(what, steps)
    for i in range(steps):
        t0 = time.perf_counter()
        m = trainer.step().metrics
        bar.update(i + 1, f"reward {m['reward/mean']:.2f}, last step {time.perf_counter() - t0:.1f} s")
    return bar.finish(f"reward of the last step {trainer.history[-1]['reward/mean']:.2f}")


@contextmanager
def shown_wait(what: str, expected: str = ""):
    """One line for a wait with no steps to count: what it is and how long it is expected to take
    (as measured), then the time it took. A display_data output like `Progress`, not a widget."""
    t0 = time.perf_counter()
    handle = _show({"text/plain": f"{what}…{f' ({expected})' if expected else ''}"})
    yield
    _show({"text/plain": f"{what}: done in {time.perf_counter() - t0:.1f} s"}, handle)


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
    bar = Progress("refreshed and stale runs", 2 * steps * len(seeds))
    for seed in seeds:
        for arm in ARMS:
            trainer = make_trainer(arm, seed)
            try:
                for _ in range(steps):
                    reward = trainer.step().metrics["reward/mean"]
                    bar.advance(note=f"seed {seed}, {arm} run: step {trainer.step_count}, reward {reward:.2f}")
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
    bar.finish()
    return out


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
