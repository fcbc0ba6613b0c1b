"""GSM8K answer extraction and rewards: one definition of "correct", used by training and eval.

>>> extract_answer("so 3 + 4 = 7\\n#### 7")
'7'
>>> extract_answer("The answer is $1,000.", mode="flexible")
'1000'
>>> gsm8k_reward("#### 18.0", "18")
1.0
"""
from __future__ import annotations

import re
from decimal import Context, Decimal, InvalidOperation

# a number as people write it: optional sign and $, digits with thousands commas, optional decimals
_NUMBER = r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_STRICT = re.compile(r"####\s*(" + _NUMBER + r")")
_FLEXIBLE = re.compile(_NUMBER)
# a number with a digit this far from the point is no answer (Python prints no int of more than 4,300 digits)
MAX_DIGITS = 1000


def normalize_number(text: str) -> str | None:
    """'$1,000.50' -> '1000.5', '18.0' -> '18'; None if not a number of at most MAX_DIGITS digits (none
    that far from the point). The one reading of a number the rewards, eval and data check share."""
    cleaned = text.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite() or len(value.as_tuple().digits) > MAX_DIGITS or abs(value.adjusted()) >= MAX_DIGITS:
        return None
    normalized = value.normalize(Context(prec=MAX_DIGITS))   # exact: the default context rounds to 28 digits
    # Decimal('1E+3').normalize() prints in exponent form; force plain notation
    return format(normalized, "f") if normalized != normalized.to_integral() else str(int(normalized))


def extract_answer(text: str, mode: str = "strict") -> str | None:
    """Strict: the number after the last '#### '. Flexible: the last number anywhere."""
    if mode not in ("strict", "flexible"):
        raise ValueError(f"extract_answer mode={mode!r}: use 'strict' or 'flexible'")
    matches = (_STRICT if mode == "strict" else _FLEXIBLE).findall(text)
    return normalize_number(matches[-1]) if matches else None


def has_strict_format(text: str) -> bool:
    return _STRICT.search(text) is not None


def gsm8k_reward(completion: str, answer: str, mode: str = "strict", format_bonus: float = 0.0) -> float:
    """1.0 if the extracted answer equals `answer` as a number, else 0.0; plus `format_bonus`
    whenever '#### N' is present (right or wrong)."""
    predicted, truth = extract_answer(completion, mode), normalize_number(answer)
    if truth is None:
        raise ValueError(f"ground-truth answer {answer!r} is not a number; GSM8K answers end with '#### N'")
    reward = 1.0 if predicted is not None and predicted == truth else 0.0
    return reward + format_bonus if format_bonus and has_strict_format(completion) else reward


# --- reward functions: fn(prompts, completions, **kwargs) -> list[float], one signature, pluggable ----
def correct_strict(prompts: list[str], completions: list[str], answers: list[str], **kwargs) -> list[float]:
    """1.0 where the number after the last '#### ' equals the answer.

    >>> correct_strict(["q", "q"], ["so 7\\n#### 7", "The answer is 7."], answers=["7", "7"])
    [1.0, 0.0]
    """
    return [gsm8k_reward(c, a, "strict") for c, a in zip(completions, answers)]


def correct_flexible(prompts: list[str], completions: list[str], answers: list[str], **kwargs) -> list[float]:
    """1.0 where the last number in the completion equals the answer.

    >>> correct_flexible(["q"], ["The answer is 7."], answers=["7"])
    [1.0]
    """
    return [gsm8k_reward(c, a, "flexible") for c, a in zip(completions, answers)]


def strict_format(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """1.0 where '#### N' is present, right or wrong (a format bonus when weighted > 0).

    >>> strict_format(["q", "q"], ["#### 3", "3"])
    [1.0, 0.0]
    """
    return [float(has_strict_format(c)) for c in completions]


# what each reward pays for, in words (the step panel explains the reward with it)
correct_strict.rule = "its last '#### N' is the right number"
correct_flexible.rule = "its last number is right"
strict_format.rule = "it ends with '#### N', right or wrong"


def reward_functions(mode: str = "strict", format_bonus: float = 0.0) -> list[tuple[str, object, float]]:
    """(name, fn, weight) for the configured reward: correctness, plus the format bonus if any.
    Each is logged as reward/<name>/mean; the step's reward is the weighted sum."""
    if mode not in ("strict", "flexible"):
        raise ValueError(f"reward mode {mode!r}: use 'strict' or 'flexible'")
    fns = [("correct", correct_strict if mode == "strict" else correct_flexible, 1.0)]
    if format_bonus:
        fns.append(("format", strict_format, format_bonus))
    return fns
