"""Answer extraction and GSM8K rewards: one definition of "correct" for training and evaluation."""
import pytest

from lorabench.rewards import (correctness_reward, extract_answer, gsm8k_reward, has_strict_format,
                               normalize_number)


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


def test_batch_reward_matches_single_reward():
    completions = ["#### 5", "#### 6", "The answer is 5."]
    answers = ["5", "5", "5"]
    assert correctness_reward(["q"] * 3, completions, answers) == [
        gsm8k_reward(c, a) for c, a in zip(completions, answers)]
    assert correctness_reward(["q"] * 3, completions, answers) == [1.0, 0.0, 0.0]
