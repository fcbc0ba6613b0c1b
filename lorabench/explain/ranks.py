"""Notebook 04: which LoRA rank does RL need? The verdict from the run's held-out rewards.
"""
from __future__ import annotations

from .step import share_se


def rank_verdict(after: dict[str, dict], before: dict[str, dict], key: str = "strict") -> tuple[str, list[str]]:
    """Markdown that compares the policies' held-out `key` share after training (greedy evaluations:
    name -> trainer.evaluate row, in the order of what varies, e.g. the rank; `before`: the same
    before the first step), each with its standard error, and the names within two standard errors
    of the best (a tie at this sample size). Whatever the numbers are, the sentence says what they
    show: nothing learned yet, a tie, a gap at one end of the order, or one that does not follow it."""
    share = {name: e[key] for name, e in after.items()}
    n = next(iter(after.values()))["n"]
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
