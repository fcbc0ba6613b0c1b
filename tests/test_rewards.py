"""Answer extraction and GSM8K rewards: one definition of "correct" for training and evaluation, and
the pluggable reward functions (one signature) the trainer sums per completion."""
import doctest
import inspect

import pytest
import torch

from lorabench import rewards as rewards_module
from lorabench.data import Problem
from lorabench.engines.base import Completion
from lorabench.rewards import (
    correct_flexible,
    correct_strict,
    extract_answer,
    gsm8k_reward,
    has_strict_format,
    normalize_number,
    reward_functions,
    strict_format,
)
from lorabench.rollout import Rollouts, score


@pytest.mark.parametrize("text, expected", [
    ("so 3 + 4 = 7\n#### 7", "7"),
    ("#### 1,000", "1000"),
    ("#### $18", "18"),
    ("#### 18.0", "18"),
    ("#### 18.50", "18.5"),
    ("#### 0.25", "0.25"),
    ("#### -3", "-3"),
    ("####42", "42"),
    ("#### 12.", "12"),                         # trailing period ends the sentence
    ("#### 5\nwait, no\n#### 6", "6"),           # the last '####' wins
    ("#### 1,234,567", "1234567"),
    ("#### 1000000", "1000000"),                # no exponent notation for round numbers
])
def test_strict_extracts_number_after_last_hashes(text, expected):
    assert extract_answer(text, "strict") == expected


@pytest.mark.parametrize("text", [
    "The answer is 7.",                          # no '####' at all
    "#### seven",                                # no number after '####'
    "####",
    "",
    "= 7",
])
def test_strict_without_hashes_number_is_none(text):
    assert extract_answer(text, "strict") is None


@pytest.mark.parametrize("text, expected", [
    ("The answer is 7.", "7"),
    ("3 + 4 = 7 so we get 8", "8"),              # the last number anywhere
    ("The answer is $1,000.", "1000"),
    ("It costs 2.50 dollars", "2.5"),
    ("#### 12", "12"),
    ("= -4", "-4"),
])
def test_flexible_takes_last_number(text, expected):
    assert extract_answer(text, "flexible") == expected


def test_flexible_no_number_is_none():
    assert extract_answer("no digits here", "flexible") is None


def test_strict_and_flexible_differ_where_format_matters():
    text = "#### 3 and later the text mentions 9"
    assert extract_answer(text, "strict") == "3"
    assert extract_answer(text, "flexible") == "9"


def test_bad_mode_raises():
    with pytest.raises(ValueError, match="mode"):
        extract_answer("#### 1", "lenient")


@pytest.mark.parametrize("a, b", [("18", "18.0"), ("1,000", "1000"), ("$18", "18"), ("0.50", ".5"),
                                  ("-3", "-3.00")])
def test_normalize_number_equates_spellings(a, b):
    assert normalize_number(a) == normalize_number(b) is not None


@pytest.mark.parametrize("text", ["abc", "", "nan", "inf", "1e"])
def test_normalize_number_rejects_non_numbers(text):
    assert normalize_number(text) is None


@pytest.mark.parametrize("completion, truth", [
    ("#### 18", "18.0"),
    ("#### 18.0", "18"),
    ("#### 1,000", "1000"),
    ("#### 1000", "1,000"),
    ("#### $18", "18"),
    ("reasoning\n#### -3", "-3"),
])
def test_reward_numeric_equality(completion, truth):
    assert gsm8k_reward(completion, truth) == 1.0


@pytest.mark.parametrize("completion, truth", [
    ("#### 19", "18"),
    ("#### 180", "18"),
    ("#### 1.8", "18"),
    ("#### -18", "18"),
    ("The answer is 18.", "18"),                 # right number, wrong format: strict pays nothing
])
def test_reward_wrong_answers_score_zero(completion, truth):
    assert gsm8k_reward(completion, truth) == 0.0


def test_reward_flexible_mode_accepts_unformatted_answer():
    assert gsm8k_reward("The answer is 18.", "18", mode="flexible") == 1.0
    assert gsm8k_reward("The answer is 17.", "18", mode="flexible") == 0.0


def test_format_bonus_paid_for_format_right_or_wrong():
    assert gsm8k_reward("#### 18", "18", format_bonus=0.1) == pytest.approx(1.1)
    assert gsm8k_reward("#### 17", "18", format_bonus=0.1) == pytest.approx(0.1)
    assert gsm8k_reward("The answer is 18.", "18", format_bonus=0.1) == 0.0
    assert gsm8k_reward("The answer is 18.", "18", mode="flexible", format_bonus=0.1) == 1.0
    assert has_strict_format("x\n#### 4") and not has_strict_format("#### four")


@pytest.mark.parametrize("truth", ["eighteen", "", "#### 18"])
def test_non_numeric_ground_truth_raises(truth):
    with pytest.raises(ValueError, match="ground-truth"):
        gsm8k_reward("#### 18", truth)


COMPLETIONS = ["#### 5", "#### 6", "The answer is 5.", "so 5 + 1 = 6\n#### 6.0", "", "#### 1,000"]
ANSWERS = ["5", "5", "5", "6", "5", "1000"]


def test_reward_functions_match_single_reward():
    prompts = ["q"] * len(COMPLETIONS)
    assert correct_strict(prompts, COMPLETIONS, answers=ANSWERS) == [
        gsm8k_reward(c, a, "strict") for c, a in zip(COMPLETIONS, ANSWERS)] == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert correct_flexible(prompts, COMPLETIONS, answers=ANSWERS) == [
        gsm8k_reward(c, a, "flexible") for c, a in zip(COMPLETIONS, ANSWERS)] == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert strict_format(prompts, COMPLETIONS, answers=ANSWERS) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("fn", [correct_strict, correct_flexible, strict_format])
def test_reward_function_signature(fn):
    """fn(prompts, completions, answers=..., **kwargs) -> list[float], one value per completion;
    keyword arguments a function does not use are accepted and ignored."""
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params[:2]] == ["prompts", "completions"]
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD
    out = fn(["q"] * len(COMPLETIONS), COMPLETIONS, answers=ANSWERS, step=3, questions=["x"])
    assert isinstance(out, list) and len(out) == len(COMPLETIONS) and all(type(v) is float for v in out)
    assert fn([], [], answers=[]) == []


def test_reward_functions_by_mode():
    assert reward_functions("strict") == [("correct", correct_strict, 1.0)]
    assert reward_functions("flexible") == [("correct", correct_flexible, 1.0)]
    assert reward_functions("strict", format_bonus=0.1) == [("correct", correct_strict, 1.0),
                                                            ("format", strict_format, 0.1)]
    with pytest.raises(ValueError, match="lenient"):
        reward_functions("lenient")


def test_score_sums_weighted_rewards_and_reports_each_mean():
    """rollout.score: the step's reward per completion is the weighted sum of the functions, each
    function's mean is logged as reward/<name>/mean, and answers travel with their group."""
    problems = [Problem("q0", "#### 5", "5"), Problem("q1", "#### 6", "6")]
    texts = ["#### 5", "The answer is 5.", "#### 7", "6"]                 # 2 prompts x 2 completions
    completions = [Completion([1], [2], [-0.5], "stop") for _ in texts]
    rollouts = Rollouts(problems, completions, texts, adapter="policy", served_version=0)
    assert rollouts.group_size == 2 and rollouts.answers == ["5", "5", "6", "6"]
    total, means = score(rollouts, reward_functions("strict", format_bonus=0.25))
    assert torch.equal(total, torch.tensor([1.25, 0.0, 0.25, 0.0]))
    assert means == {"reward/correct/mean": 0.25, "reward/format/mean": 0.5}
    total, means = score(rollouts, reward_functions("flexible"))
    assert torch.equal(total, torch.tensor([1.0, 1.0, 0.0, 1.0]))
    assert means == {"reward/correct/mean": 0.75}

    def length_penalty(prompts, completions, **kwargs):     # a user's own function plugs in the same way
        assert prompts == ["q0", "q0", "q1", "q1"] and kwargs["answers"] == rollouts.answers
        return [-float(len(c)) for c in completions]
    total, means = score(rollouts, [("length", length_penalty, 0.5)])
    assert torch.equal(total, torch.tensor([-3.0, -8.0, -3.0, -0.5]))
    assert means == {"reward/length/mean": pytest.approx(-7.25)}


def test_rewards_docstring_examples():
    result = doctest.testmod(rewards_module)
    assert result.attempted >= 6 and result.failed == 0


def test_numbers_too_long_are_no_answer():
    """A completion with 5,000 digits after '####' raised ValueError in the reward (Python prints no
    int of more than 4,300 digits); 1e999999999 in a data file would print as a billion digits; and
    numbers of more than 28 digits were compared rounded to 28 (Decimal's default precision)."""
    assert gsm8k_reward("#### " + "7" * 5000, "7") == 0.0
    assert gsm8k_reward("#### 1" + "0" * 30 + "2", "1" + "0" * 30 + "1") == 0.0
    assert normalize_number("7" * 1000) == "7" * 1000 and normalize_number("7" * 1001) is None
    assert normalize_number("1e999999999") is None and normalize_number("1e-1000") is None
