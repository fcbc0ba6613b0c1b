"""The sentences notebook 01 generates from its numbers (lorabench.explain): every direction word
is chosen from the numbers (rose / fell / held within two standard errors), never assumed, and the
advantage note states what loss.group_advantages computes."""
import pytest
import torch

from lorabench import explain
from lorabench.loss import group_advantages


def evals(fmt, flexible, strict, n=128):
    return {"format": fmt, "flexible": flexible, "strict": strict, "n": n}


def test_direction_counts_a_change_only_beyond_two_standard_errors():
    se = explain.share_se(0.5, 0.55, 100)                     # ~0.07: a 0.05 change is noise
    assert explain.direction(0.5, 0.55, se) == "held"
    assert explain.direction(0.5, 0.8, explain.share_se(0.5, 0.8, 100)) == "rose"
    assert explain.direction(0.8, 0.5, explain.share_se(0.8, 0.5, 100)) == "fell"
    assert explain.direction(0.0, 0.0, 0.0) == "held" and explain.direction(0.0, 1.0, 0.0) == "rose"


@pytest.mark.parametrize("after, words, verdict", [
    (evals(1.0, 0.60, 0.60), ["rose", "fell", "rose"], "the reward was learned, the arithmetic got worse"),
    (evals(1.0, 0.80, 0.80), ["rose", "held", "rose"], "not the arithmetic"),
    (evals(1.0, 0.95, 0.95), ["rose", "rose", "rose"], "more answers are right in any format"),
    (evals(0.02, 0.81, 0.02), ["held", "held", "held"], "the format did not catch on"),
])
def test_learned_summary_says_what_the_numbers_say(after, words, verdict):
    text = explain.learned_summary(evals(0.0, 0.81, 0.0), after)
    assert explain.stated_directions(text)[:3] == words, text
    assert verdict in text and f"0.81 → {after['flexible']:.2f}" in text
    assert "held-out" in text and explain.stated_directions("12 held-out problems") == []


def test_advantage_note_states_the_formula_and_counts_equal_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])      # group 0 mixed, group 1 all equal
    assert explain.equal_reward_groups(rewards, 4) == [1]
    assert group_advantages(rewards, 4)[4:].abs().sum() == 0
    note = explain.advantage_note(rewards, 4)
    a = group_advantages(rewards, 4)
    assert f"reward 1 → {a[0]:+.2f}" in note and f"reward 0 → {a[1]:+.2f}" in note
    assert "std(r) + 0.0001" in note and "**1 of 2 groups**" in note and "(group 1)" in note


def rows(mismatch, reward, gap=0.05, served=None):
    """Step records; the engine serves `served[i]` at step i + 1 (default: version 0 throughout, a stale engine)."""
    served = list(served) if served is not None else [0] * len(mismatch)
    return [{"step": i + 1, "mismatch/mean": m, "reward/mean": r, "reward/std": 0.4, "probe/adapter_gap": gap,
             "adapter/version": i + 1, "adapter/served_version": v}
            for i, (m, r, v) in enumerate(zip(mismatch, reward, served))]


def test_broken_summary_words_follow_the_numbers():
    refreshed = rows([5e-7] * 6, [0.1, 0.1, 0.2, 0.5, 0.6, 0.7])
    broken = rows([5e-7, 0.01, 0.02, 0.03, 0.04, 0.05], [0.1, 0.12, 0.1, 0.11, 0.1, 0.12])
    text = explain.broken_summary(refreshed, broken, per_step=64)
    assert explain.stated_directions(text)[:3] == ["rose", "held", "rose"], text
    assert "of the order of the refreshed run's probe gap" in text
    assert "served adapter version 0 at every step while the trainer moved on to version 6" in text, text
    flat = explain.broken_summary(refreshed, rows([5e-7, 6e-7, 5e-7, 7e-7, 5e-7, 8e-7], [0.1] * 6, served=range(6)),
                                  per_step=64)
    assert explain.stated_directions(flat)[0] == "held", flat
    assert "served versions 0 to 5" in flat, flat


def _evals(**shares):
    return {name: {"strict": p, "n": 128} for name, p in shares.items()}


@pytest.mark.parametrize("after, words, tied", [
    (_evals(r1=0.05, r8=0.06), "No policy has improved", ["r1", "r8"]),
    (_evals(r1=0.60, r8=0.62), "does **not** separate them", ["r1", "r8"]),
    (_evals(r1=0.20, r8=0.70), "behind by more than that: r1. Those behind are all at one end", ["r8"]),
])
def test_rank_verdict_says_what_the_numbers_say(after, words, tied):
    from lorabench.explain import rank_verdict
    text, got = rank_verdict(after, _evals(r1=0.05, r8=0.05))
    assert words in text and got == tied, text


def test_a_gap_that_does_not_follow_the_order_is_called_so():
    from lorabench.explain import rank_verdict
    before = _evals(r1=0.0, r4=0.0, r16=0.0, r64=0.0)
    text, tied = rank_verdict(_evals(r1=0.59, r4=0.38, r16=0.52, r64=0.50), before)
    assert tied == ["r1", "r16", "r64"] and "does not follow the rank" in text, text
