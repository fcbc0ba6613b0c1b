"""The sentences the lessons generate from their numbers (lorabench.explain): every direction word
is chosen from the numbers (rose / fell / held within two standard errors), never assumed, and the
advantage note states what loss.group_advantages computes; the browser test's claim checks
(tests/lesson_claims.py) pass on each lesson's sentences and catch a sentence that disagrees with its
numbers."""
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
    exact = explain.broken_summary(refreshed, rows([5e-7, 0, 0, 0, 0, 0.0], [0.1] * 6, served=range(6)), per_step=64)
    assert "The mismatch fell to 0" in exact and "inf" not in exact, exact   # an engine serving the trainer's adapter


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


# --- the claims the browser test reads back (tests/lesson_claims.py), on the sentences the lessons generate ---
def _rendered(*markdown: str) -> str:
    from lesson_claims import plain
    return "\n".join(plain(m) for m in markdown)


def test_notebook_01_claims_agree_with_their_numbers():
    from lesson_claims import problems
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    history = [{"reward/short/mean": 0.1, "completions/mean_length": 30.0, "reward/mean": 0.1}] * 4
    texts = [explain.learned_summary(evals(0.0, 0.81, 0.0), evals(1.0, 0.60, 0.60)),
             explain.prediction_note(2.5, rewards, 8, 0), explain.advantage_note(rewards, 8, 0),
             explain.broken_summary(rows([5e-7] * 6, [0.1] * 6, served=range(6)),
                                    rows([5e-7, 0.01, 0.02, 0.03, 0.04, 0.05], [0.1] * 6), per_step=64),
             explain.kl_penalty_note([{"step": 1, "kl/mean": 0.0}, {"step": 2, "kl/mean": 0.0123}], 0.0),
             explain.reward_exercise_note(history, "short", 2)]
    assert problems("01_step_through", _rendered(*texts)) == []
    wrong = _rendered(*texts).replace("has advantage +2.64", "has advantage +1.00")
    assert any("reveal" in p for p in problems("01_step_through", wrong))
    assert any("not rendered" in p for p in problems("01_step_through", _rendered(*texts[:2])))


def _refresh_rows():
    import json

    from lorabench.explain.refresh_costs import GPU_RESULTS
    rows = [r for r in json.loads(GPU_RESULTS.read_text())["rows"] if r["bucket_mb"] == 64]
    return list({r["mode"]: r for r in reversed(rows)}.values())   # one per mode


def test_notebook_02_claims_agree_with_their_numbers():
    from lesson_claims import problems
    rows, gpu = _refresh_rows(), explain.gpu_mode_rows()
    texts = [explain.mode_prediction_note("merged", rows), explain.modes_markdown(rows, 100.0),
             explain.cpu_gpu_markdown(rows, gpu)]
    assert problems("02_refresh_methods", _rendered(*texts)) == []
    assert "right" not in texts[0] and "`inplace`" in texts[0]   # inplace is the H200's fastest
    table = explain.cpu_gpu_table(rows, gpu)
    assert list(table["here: place"]) == [1, 2, 3, 4] and table.index[0] == "inplace"
    swapped = _rendered(texts[0].replace("machine: `inplace`", "machine: `file`"), *texts[1:])
    assert problems("02_refresh_methods", swapped)


def _summary(refreshed, stale, heldout_fresh, heldout_stale, n=64):
    seeds = len(refreshed)
    return {"last": 5, "per_seed": {"refreshed": refreshed, "stale": stale},
            "mean": {"refreshed": sum(refreshed) / seeds, "stale": sum(stale) / seeds},
            "refreshed_higher": sum(r > s for r, s in zip(refreshed, stale)),
            "stale_higher": sum(s > r for r, s in zip(refreshed, stale)),
            "heldout": {"refreshed": heldout_fresh, "stale": heldout_stale},
            "first_adapter": heldout_stale, "heldout_n": n * seeds, "stale_served": [0]}


@pytest.mark.parametrize("stale_strict, shows_heldout", [(0.17, False), (0.02, True)])
def test_notebook_03_harm_sentence_says_where_the_harm_shows(stale_strict, shows_heldout):
    from lesson_claims import problems
    fresh = {"format": 0.17, "flexible": 0.3, "strict": 0.17}
    summary = _summary([0.13, 0.14], [0.07, 0.06], fresh, {"format": 0.20, "flexible": 0.3, "strict": stale_strict})
    text, verdict = explain.harm_sentence(summary, "the same")
    assert "It shows in the served reward" in text and ("does not show" in text) != shows_heldout, text
    assert verdict == ("lower" if shows_heldout else "the same")
    assert problems("03_how_hotswap_works", _rendered(text)) == []
    tampered = text.replace(f"{summary['mean']['refreshed']:.2f} refreshed", "0.01 refreshed")
    assert problems("03_how_hotswap_works", _rendered(tampered))
    mixed, _ = explain.harm_sentence(_summary([0.13, 0.05], [0.07, 0.06], fresh, fresh))
    assert "does not show it clearly" in mixed and "higher in 1 of 2 seeds" in mixed


def test_notebook_04_update_sentence_and_reveal_follow_the_numbers():
    from lesson_claims import problems
    ranks = {"r1": 1, "r4": 4, "r16": 16, "r64": 64}
    norms = {"r1": 25.0, "r4": 18.0, "r16": 12.0, "r64": 10.0}
    histories = {n: [{"adapter/delta_norm": v, "grad_norm": 1.0, "advantage/active_groups": 0.5,
                      "loss/policy": 0.0}] for n, v in norms.items()}
    after, before = _evals(r1=0.45, r4=0.52, r16=0.38, r64=0.35), _evals(r1=0.1, r4=0.1, r16=0.1, r64=0.1)
    verdict, tied = explain.rank_verdict(after, before)
    update = explain.update_sentence(histories, ranks, 32, tied, 3e-3)
    assert "falls as the rank grows" in update and "the ones whose adapters moved least" in update, update
    reveal = explain.prediction_sentence("r1", after, tied)
    assert "Best held-out: **r4**" in reveal and ("right at this sample size" in reveal) == ("r1" in tied)
    assert problems("04_which_rank", _rendered(verdict, update, reveal)) == []
    assert problems("04_which_rank", _rendered(verdict, update.replace("r64 10", "r64 30"), reveal))
    assert "‖ΔW‖ now" in explain.update_table(histories, ranks, 32).data.columns
