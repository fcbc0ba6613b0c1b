"""Notebook 01: one GRPO step by hand, what the run learned (from its numbers), a broken refresh."""
from __future__ import annotations

import inspect
import re

import torch

from .. import metrics as m
from ..loss import group_advantages, grpo_loss
from ..metrics import KL, MEAN_LENGTH, MISMATCH, PROBE_GAP, REWARD, REWARD_STD, SERVED_VERSION, VERSION, reward_of
from ..rewards import extract_answer


def gradient_norm(params) -> float:
    """‖∇‖ over `params` as grpo's grad_norm (clip_grad_norm_, clipping nothing); their .grad set to None after."""
    norm = torch.nn.utils.clip_grad_norm_(params, float("inf")).item()
    for p in params:
        p.grad = None
    return norm


# a table that fits the notebook's width: small monospace cells, numbers and shapes never wrapped
FIT = [{"selector": "td, th", "props": "font-size: 12px; padding: 2px 6px; text-align: left; vertical-align: top"},
       {"selector": "td", "props": "white-space: nowrap"}]


def fit_table(frame, formats: dict | str | None = None, wrap: tuple[str, ...] = ()):
    """A DataFrame's Styler: `formats` as Styler.format takes them, cells unwrapped but for `wrap`'s."""
    styler = (frame.style.format(formats) if formats is not None else frame.style).set_table_styles(FIT)
    if wrap:
        styler = styler.set_properties(subset=list(wrap), **{"white-space": "normal", "min-width": "18em"})
    return styler


def tensor_shapes(tensors: dict[str, tuple[torch.Tensor, str]]):
    """One row per tensor: its shape, dtype and what it holds."""
    import pandas as pd
    frame = pd.DataFrame([{"tensor": name, "shape": str(list(t.shape)), "dtype": str(t.dtype).replace("torch.", ""),
                           "what it holds": what} for name, (t, what) in tensors.items()]).set_index("tensor")
    return fit_table(frame, wrap=("what it holds",))


def completion_end(text: str, max_chars: int = 60) -> str:
    """The last `max_chars` characters of a completion (where its `#### N` is), newlines as ⏎."""
    flat = text.replace("\n", " ⏎ ")
    return flat if len(flat) <= max_chars else "…" + flat[-(max_chars - 1):]


def group_view(batch, texts: list[str], logp, old_logp, group: int, group_size: int, clip_eps: float,
               max_chars: int = 60):
    """One group of a batch, completion by completion: reward, advantage, the answer the reward read,
    the completion's end, its tokens, mean log π and ratio, and its loss term (`grpo_loss` on its row)."""
    import pandas as pd
    rows = []
    for i in range(group * group_size, (group + 1) * group_size):
        mask = batch.completion_mask[i:i + 1]
        tokens = mask.sum().clamp(min=1)
        term, _ = grpo_loss(logp[i:i + 1].detach(), old_logp[i:i + 1], batch.advantages[i:i + 1], mask, clip_eps)
        ratio = torch.exp(logp[i].detach() - old_logp[i])
        rows.append({"reward": batch.rewards[i].item(), "advantage": batch.advantages[i].item(),
                     "'#### N' read": extract_answer(texts[i]) or "—",
                     "completion (its end)": completion_end(texts[i], max_chars), "tokens": int(mask.sum()),
                     "mean log π": ((logp[i].detach() * mask[0]).sum() / tokens).item(),
                     "mean ratio ρ": ((ratio * mask[0]).sum() / tokens).item(), "loss term": term.item()})
    return pd.DataFrame(rows).rename_axis(f"group {group}")


def equal_reward_groups(rewards: torch.Tensor, group_size: int) -> list[int]:
    """The groups whose rewards are all equal: their advantages are all 0, so they add no gradient."""
    groups = rewards.view(-1, group_size)                                   # [P, G]
    return [i for i, g in enumerate(groups) if bool((g == g[0]).all())]


def advantage_note(rewards: torch.Tensor, group_size: int, group: int = 0) -> str:
    """Markdown: `loss.group_advantages` worked out for `group`, and the groups with all-equal rewards."""
    eps = inspect.signature(group_advantages).parameters["eps"].default
    groups = rewards.view(-1, group_size)
    r = groups[group]
    mean, std = r.mean().item(), r.std(unbiased=False).item()
    equal = equal_reward_groups(rewards, group_size)
    worked = "; ".join(f"reward {v:g} → {(v - mean) / (std + eps):+.2f}" for v in sorted(set(r.tolist())))
    which = f" (group{'s' if len(equal) > 1 else ''} {', '.join(map(str, equal))})" if equal else ""
    return (f"**The advantage column.** `loss.group_advantages` gives completion *i* of a group "
            f"A<sub>i</sub> = (r<sub>i</sub> − mean(r)) / (std(r) + {eps:g}), with the mean and the population "
            f"standard deviation (divided by G = {group_size}) of that group's rewards. The same A<sub>i</sub> "
            f"goes to every token of the completion, and a group's advantages sum to 0: completions better than "
            f"their group are pushed up, worse ones down. Group {group} here: mean {mean:.2f}, std {std:.2f}, so "
            f"{worked}.\n\n"
            f"A group whose rewards are all equal has std 0 and every advantage exactly 0: it adds nothing to "
            f"the gradient, whatever its reward. In this batch **{len(equal)} of {groups.shape[0]} groups** had "
            f"equal rewards{which}, so {groups.shape[0] - len(equal)} carry the learning signal.")


def group_rewards_note(rewards: torch.Tensor, group_size: int, group: int) -> str:
    """Markdown: one group's rewards only, before its advantages are shown (the learner predicts them)."""
    r = rewards.view(-1, group_size)[group].tolist()
    return (f"**Group {group}'s rewards**, completion by completion: {', '.join(f'{v:g}' for v in r)} "
            f"(G = {group_size}; best {max(r):g}).")


def prediction_note(predicted: float | None, rewards: torch.Tensor, group_size: int, group: int) -> str:
    """Markdown: the best completion's advantage against the prediction; for 0/1 rewards the closed form."""
    r = rewards.view(-1, group_size)[group]
    advantages = group_advantages(r, group_size)
    best = advantages[r.argmax()].item()
    if predicted is None:
        verdict = "You wrote no prediction (set `my_prediction` and run the two cells again)."
    else:
        off = abs(predicted - best)
        verdict = f"You predicted {predicted:+.2f}: " + ("right (within 0.1)." if off <= 0.1 else f"off by {off:.2f}.")
    closed = ""
    if set(r.tolist()) <= {0.0, 1.0} and 0 < r.sum().item() < group_size:
        k = int(r.sum().item())
        closed = (f" With rewards 0 and 1 and k = {k} of G = {group_size} right, the mean is k/G and the "
                  f"std √(k/G·(1−k/G)), so a right answer gets √((G−k)/k) = {((group_size - k) / k) ** 0.5:+.2f} "
                  f"and a wrong one −√(k/(G−k)) = {-(k / (group_size - k)) ** 0.5:+.2f} (the eps in the "
                  f"denominator takes a little off): the rarer a success in its group, the harder it is pushed up.")
    return f"**The reveal.** The best completion of group {group} has advantage **{best:+.2f}**. {verdict}{closed}"


def kl_penalty_note(rows: list[dict], kl_beta: float, example_beta: float = 0.04) -> str:
    """Markdown: what `grpo.kl_beta` would add to the loss, from the run's `kl/mean`, beside its own kl_beta."""
    logged = [r for r in rows if r.get(KL) is not None]
    if not logged:
        return "**KL penalty.** No KL was logged in this run (`grpo.kl_metric` is off)."
    last, kl = logged[-1], logged[-1][KL]
    own = ("off (the default, as in DAPO and Dr. GRPO: a reward checked by a rule has no reward model to "
           "exploit, and the policy has to move away from the base to learn), so the column *KL to base* "
           "is a metric only" if kl_beta == 0 else f"{kl_beta:g}, so the loss holds β × KL per token")
    return (f"**KL penalty.** This run's `grpo.kl_beta` is {own}. At step {last['step']} the policy that sampled "
            f"was {kl:.2e} nats per token from the base (the table's *KL to base*: the k3 estimate on the "
            f"sampled tokens, which is what the loss would use); `grpo.kl_beta={example_beta:g}` (DeepSeekMath's β) "
            f"would add β × KL = {example_beta * kl:.1e} to that step's loss, and its gradient "
            f"β(1 − π<sub>base</sub>/π) per token pulls each log-prob back towards the base's. To train with it, "
            f"add `\"grpo.kl_beta={example_beta:g}\"` to `OVERRIDES`.")


def reward_exercise_note(rows: list[dict], name: str, steps: int) -> str:
    """Markdown: what reward `name` paid over the last `steps` rows, and the completions' length."""
    ran, before = rows[-steps:], rows[-2 * steps:-steps]
    paid = sum(r.get(reward_of(name), 0.0) for r in ran) / len(ran)

    def length(part):
        return sum(r[MEAN_LENGTH] for r in part) / len(part) if part else float("nan")
    now, then = length(ran), length(before)
    change = ("shorter" if now < then else "longer" if now > then else "as long") if before else "not compared"
    return (f"**Your reward `{name}`** paid {paid:.3f} on average over its {len(ran)} step(s) (logged as "
            f"`reward/{name}/mean`; the panel's reward line shows it as a term of `reward/mean`). The completions "
            f"were {now:.1f} tokens long on average then, {then:.1f} over the {len(before)} step(s) before: "
            f"{change}. A reward that every completion of a group earns alike moves no advantage (A subtracts "
            f"the group's mean): it teaches only where it tells the completions of one group apart.")


def direction(before: float, after: float, se: float) -> str:
    """'rose', 'fell' or 'held' (within two standard errors `se` of the difference)."""
    if abs(after - before) <= 2 * se or after == before:
        return "held"
    return "rose" if after > before else "fell"


def stated_directions(text: str) -> list[str]:
    """The direction words of a generated sentence, in order ('rose', 'fell', 'held')."""
    return re.findall(r"\b(rose|fell|held)\b(?!-)", text)


def share_se(before: float, after: float, n: int) -> float:
    """Standard error of the difference of two shares, each measured on n items."""
    return ((before * (1 - before) + after * (1 - after)) / n) ** 0.5


def learned_summary(before: dict, after: dict) -> str:
    """Markdown: what the run learned from held-out evaluations; each direction word from `direction`."""
    n, measures = after[m.HELD_COUNT], (m.HELD_FORMAT, m.HELD_FLEXIBLE, m.HELD_STRICT)
    fmt, right, reward = (direction(before[k], after[k], share_se(before[k], after[k], n)) for k in measures)
    verdict = {("rose", "fell"): "the reward was learned, the arithmetic got worse",
               ("rose", "held"): "the run learned the format the reward pays for, not the arithmetic",
               ("rose", "rose"): "the run learned the format, and more answers are right in any format too"
               }.get((fmt, right), f"the format did not catch on in this run (it {fmt}), and any-format "
                                   f"correctness {right}")
    shares = {k: f"({before[k]:.2f} → {after[k]:.2f})" for k in measures}
    return (f"**What this run learned** ({n} held-out problems, greedy): ending with `#### N` {fmt} "
            f"{shares[m.HELD_FORMAT]}, the last number right in any format {right} {shares[m.HELD_FLEXIBLE]}, "
            f"and the reward, which needs both, {reward} {shares[m.HELD_STRICT]}: **{verdict}**. (A change within two "
            f"standard errors of a share of {n} problems is called *held*.)")


def clip_note(ratio: torch.Tensor, mask: torch.Tensor, clip_eps: float, steps: int) -> str:
    """Markdown: ρ = π_now / π_old on a batch after `steps` updates, and the share the clip would hold."""
    values = ratio[mask.bool()]
    outside = ((values - 1).abs() > clip_eps).float().mean().item()
    return (f"After {steps} steps the ratio ρ = π<sub>θ</sub> / π<sub>old</sub> on these tokens spans "
            f"{values.min().item():.2f} to {values.max().item():.2f} (median {values.median().item():.2f}); "
            f"{outside:.0%} of them are outside [1 − ε, 1 + ε] = [{1 - clip_eps:g}, {1 + clip_eps:g}], where the "
            f"clip holds ρ fixed and their gradient is 0. Inside one step ρ starts at exactly 1 (π<sub>old</sub> "
            f"is the same weights), so with `grpo.epochs = 1` the clip never acts; it matters when a batch is "
            f"trained on more than once (`grpo.epochs` > 1).")


def half_means(rows: list[dict], per_step: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(mean, standard error) of reward/mean over each half of `rows` (a step's s.e.: reward/std / √per_step)."""
    half = max(1, len(rows) // 2)

    def mean_se(part):
        mean = sum(r[REWARD] for r in part) / len(part)
        return mean, (sum(r[REWARD_STD] ** 2 / per_step for r in part) ** 0.5) / len(part)
    return mean_se(rows[:half]), mean_se(rows[half:] or rows[:half])


FOLD = 10.0   # a mismatch spans decades (1e-7 when the engine serves the trainer's adapter, 1e-2 when not)


def broken_summary(refreshed: list[dict], broken: list[dict], per_step: int, mode: str = "none") -> str:
    """Markdown: the run with refresh.mode=`mode` against the refreshed one over the same steps: mismatch,
    probe gap and each run's reward direction (halves); `per_step`: completions per step."""
    k = min(len(broken), len(refreshed))
    first, last = broken[0][MISMATCH], broken[k - 1][MISMATCH]
    ref_last, gap_last = refreshed[k - 1][MISMATCH], refreshed[k - 1][PROBE_GAP]
    fold = last / max(first, 1e-12)
    climb = (f"rose {fold:.2g}-fold" if fold > FOLD else "fell to 0" if fold == 0 else
             f"fell {1 / fold:.2g}-fold" if fold < 1 / FOLD else f"held (×{fold:.2g}: under {FOLD:g}-fold either way)")
    served = [r[SERVED_VERSION] for r in broken[:k]]
    versions = (f"adapter version {served[0]} at every step" if len(set(served)) == 1 else
                f"versions {served[0]} to {served[-1]}")
    engine = f"the engine served {versions} while the trainer moved on to version {broken[k - 1][VERSION]}"
    scale = gap_last / last if last > 0 else float("inf")
    where = ("nothing beside the refreshed run's probe gap" if last == 0 else
             "of the order of the refreshed run's probe gap" if 1 / 3 <= scale <= 3 else
             f"{max(scale, 1 / scale):.0f}× {'below' if scale > 3 else 'above'} the refreshed run's probe gap")
    words = []
    for rows in (broken[:k], refreshed[:k]):
        (a, se_a), (b, se_b) = half_means(rows, per_step)
        words.append((direction(a, b, (se_a ** 2 + se_b ** 2) ** 0.5), a, b))
    (word_b, a_b, b_b), (word_r, a_r, b_r) = words
    return (f"**What breaking it showed** (`refresh.mode={mode}`, {k} steps on the same problems as the run "
            f"above): {engine}. The mismatch {climb}, "
            f"from {first:.1e} nats at step 1 (the engine still had the trainer's adapter) to {last:.1e} at step "
            f"{k}: {last / max(ref_last, 1e-12):.2g}× the refreshed run's {ref_last:.1e} there, and {where} "
            f"({gap_last:.2g}). The reward, earned by the engine's completions, {word_b} (mean {a_b:.2f} over the "
            f"first half of the steps, {b_b:.2f} over the second); in the refreshed run it {word_r} "
            f"({a_r:.2f} → {b_r:.2f}). *Held* means within two standard errors.")
