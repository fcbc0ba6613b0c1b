"""GSM8K problems: from the hub (openai/gsm8k, config 'main'), from local jsonl/parquet files, or
from a seeded offline generator of GSM8K-style word problems with the same schema.

Schema everywhere: `question` (str) and `answer` (str whose last line is '#### N'); the ground
truth is the text after '####' with commas removed. Prompts are one user chat message: the
question followed by the instruction below (as in verl's GSM8K recipe).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file, row and field."""


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str         # full solution text ending in '#### N'
    ground_truth: str   # N, commas removed

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": f"{self.question} {INSTRUCTION}"}]


def parse_ground_truth(answer: str, where: str = "answer") -> str:
    if "####" not in answer:
        raise DataError(f"{where}: answer has no '####' line ({answer[:60]!r}); GSM8K answers must end "
                        f"with '#### N'")
    truth = answer.split("####")[-1].strip().replace(",", "")
    if not truth:
        raise DataError(f"{where}: nothing after '####' in {answer[-60:]!r}; write '#### N'")
    return truth


def problems_from_rows(rows, where: str) -> list[Problem]:
    problems = []
    for i, row in enumerate(rows):
        loc = f"{where} row {i + 1}"
        for key in ("question", "answer"):
            if key not in row:
                raise DataError(f"{loc}: missing field '{key}'; each row needs 'question' and 'answer'")
            if not isinstance(row[key], str):
                raise DataError(f"{loc}: field '{key}' is a {type(row[key]).__name__} ({row[key]!r}), not a "
                                f"string; write it as text (quoted in JSON)")
            if not row[key].strip():
                raise DataError(f"{loc}: field '{key}' is empty; give a non-empty string")
        problems.append(Problem(row["question"].strip(), row["answer"], parse_ground_truth(row["answer"], loc)))
    if not problems:
        raise DataError(f"{where}: no rows; the file must hold at least one question/answer row")
    return problems


def load_gsm8k(split: str = "train", source: str = "hub") -> list[Problem]:
    """`source='hub'`: openai/gsm8k (config 'main') through `datasets` (needs the network).
    Otherwise a local .jsonl or .parquet path with question/answer fields."""
    if source == "hub":
        import datasets  # imported here: only the hub path needs it
        rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
        return problems_from_rows(rows, f"openai/gsm8k[{split}]")
    path = Path(source)
    if not path.is_file():
        raise DataError(f"dataset file {path} does not exist; pass a .jsonl or .parquet file with "
                        f"question/answer fields, 'hub' or 'synthetic'")
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {n}: not valid JSON ({err}); fix or remove that line (one JSON "
                                f"object per line)") from err
        return problems_from_rows(rows, str(path))
    if path.suffix == ".parquet":
        import pandas as pd
        return problems_from_rows(pd.read_parquet(path).to_dict("records"), str(path))
    raise DataError(f"dataset file {path}: unsupported suffix {path.suffix!r}; use .jsonl or .parquet")


# --- the offline generator -------------------------------------------------------------------
_NAMES = ["Tom", "Ana", "Sam", "Mia", "Leo", "Zoe", "Max", "Ivy", "Ben", "Eva", "Raj", "Kim"]
_ITEMS = ["apples", "pens", "books", "cards", "coins", "shells", "stickers", "eggs", "cups", "toys"]


def _one_problem(rng: random.Random) -> tuple[str, list[str], int]:
    """(question, reasoning lines, answer). Small numbers: the tiny model must be able to add."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.choice(["add", "sub", "mul", "add_sub", "add_add"])
    if kind == "add":
        a, b = rng.randint(1, 10), rng.randint(1, 10)
        q = f"{name} has {a} {item}. {name} buys {b} more {item}. How many {item} does {name} have now?"
        return q, [f"{name} has {a} + {b} = {a + b} {item}."], a + b
    if kind == "sub":
        a = rng.randint(3, 15)
        b = rng.randint(1, a - 1)
        q = f"{name} has {a} {item}. {name} gives {b} {item} to a friend. How many {item} are left?"
        return q, [f"{name} has {a} - {b} = {a - b} {item} left."], a - b
    if kind == "mul":
        a, b = rng.randint(2, 5), rng.randint(2, 5)
        q = f"{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?"
        return q, [f"{name} buys {a} * {b} = {a * b} {item}."], a * b
    if kind == "add_sub":
        a, b = rng.randint(1, 8), rng.randint(1, 8)
        c = rng.randint(1, a + b - 1)
        q = (f"{name} has {a} {item}. {name} finds {b} more and then gives away {c}. "
             f"How many {item} does {name} have now?")
        return q, [f"After finding, {name} has {a} + {b} = {a + b} {item}.",
                   f"After giving, {name} has {a + b} - {c} = {a + b - c} {item}."], a + b - c
    a, b, c = rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 6)
    q = f"{name} has {a} {item}, gets {b} on Monday and {c} on Tuesday. How many {item} does {name} have?"
    return q, [f"After Monday, {name} has {a} + {b} = {a + b} {item}.",
               f"After Tuesday, {name} has {a + b} + {c} = {a + b + c} {item}."], a + b + c


def synthetic_problems(n: int, seed: int | str) -> list[Problem]:
    """`n` GSM8K-style problems; the same (n, seed) always gives the same problems (a str seed is
    hashed with SHA-512 by `random`, independent of PYTHONHASHSEED)."""
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        question, lines, value = _one_problem(rng)
        answer = "\n".join(lines) + f"\n#### {value}"
        problems.append(Problem(question, answer, str(value)))
    return problems


def final_line_variants(value: str) -> list[str]:
    """Ways a warm-started model may end its answer; only the first earns the strict reward."""
    return [f"#### {value}", f"The answer is {value}.", f"= {value}", f"{value}"]


def warmstart_completion(problem: Problem, rng: random.Random, strict_fraction: float) -> str:
    """SFT target: the reasoning lines, then a final line that is '#### N' only `strict_fraction`
    of the time, so GRPO with the strict reward has a format to discover."""
    reasoning = problem.answer.rsplit("####", 1)[0].strip()
    variants = final_line_variants(problem.ground_truth)
    final = variants[0] if rng.random() < strict_fraction else rng.choice(variants[1:])
    return f"{reasoning}\n{final}"




def step_problems(seed: int, step: int, n: int) -> list[Problem]:
    """Fresh synthetic problems for one GRPO step, a pure function of (seed, step): a resumed run
    sees exactly the problems the uninterrupted run would have seen. Training, evaluation and
    warm-start use separate seed streams ('train-', 'eval-', 'warmstart-'), so they never share
    a random sequence."""
    return synthetic_problems(n, f"train-{seed}-{step}")


class ProblemSource:
    """Training and held-out problems from the configured source (synthetic, hub or file)."""

    def __init__(self, source: str, seed: int, eval_source: str = ""):
        self.source, self.seed = source, seed
        self._train: list[Problem] | None = None
        self._eval_source = eval_source
        for field_name, value in (("data.source", source), ("data.eval_source", eval_source)):
            if value and value not in ("synthetic", "hub") and not Path(value).is_file():
                raise DataError(f"{field_name}={value!r}: dataset file {value} does not exist; pass a .jsonl "
                                f"or .parquet file with question/answer fields, 'hub' or 'synthetic'")
        if source not in ("synthetic", "hub"):
            self._train = load_gsm8k("train", source)  # bad rows fail now, before any step runs

    def train_batch(self, step: int, n: int) -> list[Problem]:
        if self.source == "synthetic":
            return step_problems(self.seed, step, n)
        if self._train is None:
            self._train = load_gsm8k("train", self.source)
        # walk the dataset in a seeded order, fresh problems each step until it wraps around
        order = random.Random(self.seed).sample(range(len(self._train)), len(self._train))
        return [self._train[order[(step * n + i) % len(order)]] for i in range(n)]

    def eval_set(self, n: int) -> list[Problem]:
        source = self._eval_source or self.source
        if source == "synthetic":
            return synthetic_problems(n, f"eval-{self.seed}")
        split = "test" if source == "hub" else "train"
        return load_gsm8k(split, source)[:n]
