"""Notebook 04: which LoRA rank does RL need? The verdict from the run's held-out rewards."""
from __future__ import annotations

from ..metrics import ACTIVE_GROUPS, DELTA_NORM, GRAD_NORM, HELD_COUNT, HELD_STRICT, LOSS
from .step import fit_table, share_se


def rank_verdict(after: dict[str, dict], before: dict[str, dict], key: str = HELD_STRICT) -> tuple[str, list[str]]:
    """Markdown comparing the policies' held-out `key` share before and after (name -> evaluate row, by rank):
    nothing learned yet, a tie, a gap at one end of the order, or neither; and the names tied with the best."""
    share = {name: e[key] for name, e in after.items()}
    n = next(iter(after.values()))[HELD_COUNT]
    se = {name: (p * (1 - p) / n) ** 0.5 for name, p in share.items()}
    listed = ", ".join(f"{name} {before[name][key]:.2f} → {share[name]:.2f} (± {se[name]:.2f})" for name in share)
    head = f"Held-out, greedy ({n} problems), the strict reward per policy before → after: {listed}."
    learned = [name for name in share
               if share[name] - before[name][key] > 2 * share_se(before[name][key], share[name], n)]
    if not learned:
        return (f"{head} No policy has improved by more than two standard errors yet: this run is too short (or its "
                f"sample too small) to say anything about rank. Run more steps (Run N above) and evaluate again.",
                list(share))
    best = max(share, key=share.get)
    tied = [name for name in share if share[best] - share[name] <= 2 * (se[best] ** 2 + se[name] ** 2) ** 0.5]
    if len(tied) == len(share):
        tail = (f"The best is {best}, and every policy is within two standard errors of it: at this size and length "
                f"of run the rank does **not** separate them, which is what LoRA Without Regret reports for "
                f"policy-gradient RL (rank 1 learning as well as much larger ranks).")
    else:
        names = list(share)   # in the order the policies were given: by rank in notebook 04
        behind = [name for name in names if name not in tied]
        at_one_end = behind in (names[:len(behind)], names[len(names) - len(behind):])
        tail = (f"The best is **{best}**; within two standard errors of it: {', '.join(tied)}; behind by more than "
                f"that: {', '.join(behind)}. "
                + ("Those behind are all at one end of the list, so here the rank **did** matter." if at_one_end else
                   "Those behind are not at one end of the list but between policies that did as well as the best, "
                   "so this does not follow the rank: on one seed it is as likely this run's chance (its samples, "
                   "its initialisation) as the rank's capacity. Run another seed to tell them apart."))
    return f"{head} {tail}", tied


def update_table(histories: dict[str, list[dict]], ranks: dict[str, int], alpha: float):
    """Per policy: rank, α/r, ‖ΔW‖ now, and the means over its steps of ‖∇‖, groups with signal, loss."""
    import pandas as pd
    rows = []
    for name, h in histories.items():
        mean = {k: sum(r[k] for r in h) / len(h) for k in (GRAD_NORM, ACTIVE_GROUPS, LOSS)}
        rows.append({"policy": name, "rank r": ranks[name], "α/r": alpha / ranks[name],
                     "‖ΔW‖ now": h[-1][DELTA_NORM], "‖∇‖ mean": mean[GRAD_NORM],
                     "groups with signal": mean[ACTIVE_GROUPS], "loss mean": mean[LOSS]})
    return fit_table(pd.DataFrame(rows).set_index("policy"), {"α/r": "{:g}", "‖ΔW‖ now": "{:.3g}", "‖∇‖ mean": "{:.3g}",
                                                              "groups with signal": "{:.0%}", "loss mean": "{:+.1e}"})


def update_sentence(histories: dict[str, list[dict]], ranks: dict[str, int], alpha: float, tied: list[str],
                    lr: float) -> str:
    """Markdown: each adapter's ‖ΔW‖ against its rank, and whether the policies behind the best moved least."""
    norms = {name: rows[-1][DELTA_NORM] for name, rows in histories.items()}
    by_rank = sorted(norms, key=lambda n: ranks[n])
    values = [norms[n] for n in by_rank]
    falling = all(a > b for a, b in zip(values, values[1:]))
    rising = all(a < b for a, b in zip(values, values[1:]))
    trend = ("falls as the rank grows, at every step up" if falling else
             "grows with the rank, at every step up" if rising else "does not follow the rank")
    listed = ", ".join(f"{n} {norms[n]:.3g}" for n in by_rank)
    text = (f"**The update size per rank.** After {len(next(iter(histories.values())))} steps ‖ΔW‖ is {listed}: it "
            f"{trend}. Every policy has the same learning rate ({lr:g}) and α ({alpha:g}), and ΔW = (α/r)·B·A "
            f"multiplies B·A by α/r ({', '.join(f'{alpha / ranks[n]:g}' for n in by_rank)}): "
            + ("here the smaller the rank, the further the same steps moved its adapter. " if falling else
               "how far the same steps moved each adapter differs by rank. "))
    behind = [n for n in norms if n not in tied]
    if not behind:
        text += ("No policy is behind the best by more than two standard errors, so at this learning rate and "
                 "length of run neither the rank's room nor the update size separated them.")
    elif all(norms[b] < min(norms[t] for t in tied) for b in behind):
        text += (f"The policies behind ({', '.join(behind)}) are the ones whose adapters moved least: here the rank "
                 f"comparison is also a comparison of how far each policy got at this learning rate. LoRA Without "
                 f"Regret's claim, that even rank 1 has enough room for RL, is about capacity at each rank's own "
                 f"best learning rate; this run does not contradict it, and a learning-rate sweep per rank (Try it, "
                 f"below) is how to tell the two apart.")
    else:
        text += (f"The policies behind ({', '.join(behind)}) are not simply those that moved least, so the update "
                 f"size alone does not explain the gap; on one seed it may be chance as much as the rank.")
    return text


def prediction_sentence(predicted: str | None, after: dict[str, dict], tied: list[str], key: str = HELD_STRICT) -> str:
    """The learner's predicted winner against the best held-out policy (and those tied with it)."""
    best = max(after, key=lambda n: after[n][key])
    with_it = [n for n in tied if n != best]
    head = f"**The reveal.** Best held-out: **{best}**" + (f" (tied within two standard errors: {', '.join(with_it)})"
                                                           if with_it else "") + "."
    if predicted is None:
        return head + " You wrote no prediction (set `my_prediction` before the run)."
    if predicted not in after:
        return head + f" `{predicted}` is not one of the policies ({', '.join(after)})."
    return head + (f" You predicted {predicted}: " + ("right." if predicted == best else
                   "tied with the best, so right at this sample size." if predicted in tied else "not this time."))
