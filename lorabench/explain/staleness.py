"""Notebook 03: what a stale adapter does to learning (refreshed vs stale runs over seeds), and one group's
advantages and clipped loss with a fresh and a stale engine."""
from __future__ import annotations

import torch
from matplotlib.ticker import MaxNLocator

from ..loss import grpo_loss, token_logprobs
from ..metrics import HELD_COUNT, HELD_FLEXIBLE, HELD_FORMAT, HELD_STRICT, MISMATCH, REWARD, SERVED_VERSION
from ..progress import WaitProgress
from ..viz import label_axes, labelled_figure
from .checks import rollout_sequences, trainer_vs_engine
from .hotswap import last_mean
from .step import completion_end, direction, fit_table, share_se

ARMS = ("refreshed", "stale")


def refreshed_vs_stale(make_trainer, steps: int, seeds) -> dict:
    """Per seed and arm, `steps` GRPO steps of `make_trainer(arm, seed)` (stale: refresh.mode=none) on one engine;
    then each trainer's held-out greedy reward with its own adapter served (stale: after `refresh_once`)."""
    seeds = list(seeds)
    out = {"seeds": seeds, "steps": steps, "rows": {a: [] for a in ARMS}, "heldout": {a: [] for a in ARMS},
           "first_adapter": [], "check": []}
    what, total, done = "refreshed and stale runs", 2 * steps * len(seeds), 0
    with WaitProgress(what) as progress:
        progress(what, 0, total)
        for seed in seeds:
            for arm in ARMS:
                trainer = make_trainer(arm, seed)
                try:
                    for _ in range(steps):
                        reward = trainer.step().metrics[REWARD]
                        done += 1
                        progress(what, done, total,
                                 note=f"seed {seed}, {arm} run: step {trainer.step_count}, reward {reward:.2f}")
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
    return out


def refresh_once(trainer) -> dict:
    """Trainer vs engine on the engine's greedy completions, and one group's loss on a held-out problem,
    before and after one real (tensor) refresh of the trainer's adapter."""
    from ..refresh import make_refresher
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
            "heldout_n": sum(e[HELD_COUNT] for e in result["heldout"]["refreshed"]),   # problems scored, all seeds
            "stale_served": sorted({r[SERVED_VERSION] for rows in result["rows"]["stale"] for r in rows})}


HELDOUT_MEASURES = {HELD_FORMAT: "answers ending '#### N'", HELD_FLEXIBLE: "last number right, any format",
                    HELD_STRICT: "right and ending '#### N' (the strict reward)"}


def heldout_means(evaluations: list[dict]) -> dict[str, float]:
    """The mean over seeds of each held-out measure of GRPOTrainer.evaluate."""
    return {k: sum(e[k] for e in evaluations) / len(evaluations) for k in HELDOUT_MEASURES}


def heldout_table(summary: dict):
    """Held-out greedy measures (means over seeds) of the first adapter and of each trainer's."""
    import pandas as pd
    columns = {"first adapter (the stale engine's)": summary["first_adapter"],
               "refreshed trainer": summary["heldout"]["refreshed"],
               "stale trainer, after one refresh": summary["heldout"]["stale"]}
    table = pd.DataFrame({c: {HELDOUT_MEASURES[k]: v[k] for k in HELDOUT_MEASURES} for c, v in columns.items()})
    return table.style.format("{:.0%}")


ARM_COLORS = {"refreshed": "#4c72b0", "stale": "#c44e52"}


def plot_refreshed_vs_stale(result: dict):
    """Reward and mismatch per step, refreshed vs stale: a thin line per seed, their mean thick."""
    fig, axes = labelled_figure("refreshed_vs_stale", 1, 2, figsize=(13, 4.0))
    steps, floor = range(1, result["steps"] + 1), 1e-9   # a mismatch of exactly 0 has no place on a log axis
    for ax, key, transform in ((axes[0], REWARD, float), (axes[1], MISMATCH, lambda v: max(v, floor))):
        for arm in ARMS:
            runs = [[transform(r[key]) for r in rows] for rows in result["rows"][arm]]
            for values in runs:
                ax.plot(steps, values, "-", color=ARM_COLORS[arm], alpha=0.35, lw=1)
            ax.plot(steps, [sum(v) / len(v) for v in zip(*runs)], "-", color=ARM_COLORS[arm], lw=2.5,
                    label=f"{arm}, mean of {len(runs)} seed{'s' if len(runs) > 1 else ''}")
        ax.plot([], [], "-", color="#777777", alpha=0.5, lw=1, label="one seed")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    # rewards are >= 0; the top follows the data (a format bonus adds to 1)
    label_axes(axes[0], "Reward: the engine's rollouts, scored", ncol=2, xlabel="GRPO step",
               ylabel="reward of the step's completions", ylim=(-0.02, None))
    label_axes(axes[1], "Mismatch: does the engine serve the trainer's policy?", ncol=2, xlabel="GRPO step",
               ylabel="|trainer − engine| log-prob, mean", yscale="log")
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
    """Markdown: each trainer's adapter against the first one on held-out problems, per measure."""
    first, parts = summary["first_adapter"], []
    for k, what in HELDOUT_MEASURES.items():
        values = {arm: summary["heldout"][arm][k] for arm in ARMS}
        ref = round(100 * first[k])   # compared as the whole per cents shown
        moved = [f"the {arm} trainer's {v:.0%} "
                 f"({'higher' if round(100 * v) > ref else 'lower' if round(100 * v) < ref else 'the same'})"
                 for arm, v in values.items()]
        parts.append(f"{what}: the first adapter {first[k]:.0%}, {', '.join(moved)}")
    return ("Held-out, greedy (means over the seeds), " + "; ".join(parts) + ". The stale trainer learned from "
            "the first adapter's rollouts only; what its own adapter does shows once it is served.")


@torch.no_grad()
def one_group_loss(trainer, problem, step: int) -> dict:
    """One group for `problem` from the served adapter through the package's advantages and clipped loss, with
    π_old = the trainer's log-probs (as Policy.train) and = the engine's."""
    from ..rollout import sample
    g, name = trainer.settings, trainer.refresher.serving_adapter
    rollouts = sample(trainer.engine, trainer.tokenizer, [problem], g.group_size, trainer.sampling(step), name,
                      trainer.enable_thinking)
    batch = trainer.scored(rollouts)[0].to(trainer.device)
    with trainer.policy.compute():
        logp = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, g.temperature).float()
    mask = batch.completion_mask                                                 # [G, L-1]
    own_loss, own = grpo_loss(logp, logp, batch.advantages, mask, g.clip_eps)    # what the trainer computes
    sampler_loss, sampler = grpo_loss(logp, batch.engine_logprobs, batch.advantages, mask, g.clip_eps)
    ratio = torch.exp(logp - batch.engine_logprobs)[mask.bool()].cpu()          # [tokens] π_θ / π_sampler
    return {"served_version": rollouts.served_version, "trainer_version": trainer.step_count,
            "clip_eps": g.clip_eps, "rewards": batch.rewards.cpu(), "advantages": batch.advantages.cpu(),
            "tokens": mask.sum(1).int().cpu(), "texts": rollouts.texts, "ratio": ratio,
            "shapes": {"input_ids": tuple(batch.input_ids.shape), "logp": tuple(logp.shape),
                       "advantages": tuple(batch.advantages.shape)},
            "own": {"loss": own_loss.item(), **own}, "sampler": {"loss": sampler_loss.item(), **sampler}}


def group_table(group: dict, width: int = 60):
    """Per completion: reward, advantage, tokens and mean ratio π_θ / π_sampler."""
    import pandas as pd
    mask_lengths = group["tokens"].tolist()
    ratios = [float(part.mean()) if len(part) else float("nan") for part in group["ratio"].split(mask_lengths)]
    frame = pd.DataFrame({"reward r": group["rewards"].tolist(),
                          "advantage (r − mean)/std": group["advantages"].tolist(),
                          "tokens": mask_lengths, "mean π_θ/π_sampler": ratios,
                          "completion (its end, where '#### N' is)": [completion_end(t.strip(), width)
                                                                      for t in group["texts"]]})
    return fit_table(frame, {"reward r": "{:.2f}", "advantage (r − mean)/std": "{:+.2f}",
                             "mean π_θ/π_sampler": "{:.4f}"})


def group_loss_table(groups: dict):
    """Per group: the loss and clip_fraction with π_old = the trainer's log-probs and = the sampler's."""
    import pandas as pd
    rows = {}
    for label, g in groups.items():
        row = {}
        for old, side in (("trainer", g["own"]), ("sampler", g["sampler"])):
            row |= {f"loss, π_old = {old}": side["loss"], f"outside 1 ± ε, π_old = {old}": side["clip_fraction"]}
        row |= {"π_θ/π_sampler min": float(g["ratio"].min()), "π_θ/π_sampler max": float(g["ratio"].max())}
        rows[f"{label}: engine served v{g['served_version']}, trainer at v{g['trainer_version']}"] = row
    table = pd.DataFrame(rows).T
    return fit_table(table, {c: "{:+.2e}" if c.startswith("loss") else "{:.1%}" if c.startswith("outside") else "{:.4f}"
                             for c in table.columns})


def group_loss_sentence(stale: dict, fresh: dict) -> str:
    """What the two groups show, from their numbers (Markdown)."""
    eps, (lo, hi), (lo2, hi2) = stale["clip_eps"], *((float(g["ratio"].min()), float(g["ratio"].max()))
                                                      for g in (stale, fresh))
    return (f"With π_old = its own log-probs (as `Policy.train` takes it) the ratio is exactly 1: "
            f"{stale['own']['clip_fraction']:.0%} of the stale engine's tokens lie outside 1 ± {eps:g}, and "
            f"{fresh['own']['clip_fraction']:.0%} after the refresh. The loss cannot see who sampled them. Measured "
            f"against the policy that did sample them, the stale engine's tokens have ratios from {lo:.2f} to "
            f"{hi:.2f}, and {stale['sampler']['clip_fraction']:.0%} of them lie outside 1 ± {eps:g}; after one "
            f"refresh {lo2:.3f} to {hi2:.3f}, {fresh['sampler']['clip_fraction']:.0%} outside. The stale trainer "
            f"takes each step as if its rollouts were its own; only the mismatch check (`mismatch/*`) tells them "
            f"apart.")


def harm_sentence(summary: dict, predicted: str | None = None) -> tuple[str, str]:
    """(Markdown: where a stale refresh's harm shows, verdict): the stale trainer's held-out strict reward
    'lower', 'the same' or 'higher' (two s.e.); the served reward counts if every seed agrees."""
    n, mean, seeds = summary["heldout_n"], summary["mean"], len(summary["per_seed"]["refreshed"])
    shows_served = summary["refreshed_higher"] == seeds
    scores = (f"{mean['refreshed']:.2f} refreshed against {mean['stale']:.2f} stale over the last {summary['last']} "
              f"steps")
    served = (f"**It shows in the served reward**: the engine's rollouts scored {scores} "
              f"({mean['refreshed'] - mean['stale']:+.2f}, the refreshed run higher in every seed), because the stale "
              f"engine kept serving the first adapter" if shows_served else
              f"The served reward does not show it clearly in these runs: {scores}, the refreshed run higher in "
              f"{summary['refreshed_higher']} of {seeds} seeds")
    parts, words = [], {}
    for k, what in HELDOUT_MEASURES.items():
        fresh, stale = summary["heldout"]["refreshed"][k], summary["heldout"]["stale"][k]
        word = direction(fresh, stale, share_se(fresh, stale, n))
        words[k] = {"rose": "higher", "fell": "lower", "held": "the same"}[word]
        parts.append(f"{what} {stale:.0%} stale against {fresh:.0%} refreshed ({words[k]}"
                     f"{' within two standard errors' if word == 'held' else ''})")
    verdict = words[HELD_STRICT]
    unharmed = all(w != "lower" for w in words.values())
    heldout = "**On held-out problems it does not show**" if unharmed else "**On held-out problems it shows too**"
    if unharmed and shows_served:
        close = ("The stale trainer still took every gradient step, on the first adapter's rollouts: in these runs "
                 "what the stale refresh cost is what the engine served meanwhile, not what the trainer learned.")
    elif unharmed:
        close = ("In these runs it shows in neither: the first adapter and the trainers' own earn about the same "
                 "reward after this few steps, and the check that sees the stale engine at once is the mismatch "
                 "(right plot).")
    else:
        close = "The stale trainer learned from the first adapter's rollouts only, and its own adapter is behind too."
    text = (f"**Where the harm shows.** {served}. {heldout}, each trainer's own adapter served "
            f"({n // seeds} problems × {seeds} seed{'s' if seeds > 1 else ''}, greedy): {'; '.join(parts)}. {close}")
    if predicted is not None:
        text += (f"\n\nYou predicted the stale trainer's held-out reward to be *{predicted}*: it is *{verdict}* "
                 f"({'right' if predicted == verdict else 'not what the numbers say'}).")
    return text, verdict
