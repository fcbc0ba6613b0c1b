"""GSM8K problems: from the hub (openai/gsm8k), local jsonl/parquet files (datafiles.py), or a seeded offline
generator. Rows have `question` and `answer` (last line '#### N'; the ground truth is N without commas); a
prompt is one user message: the question and INSTRUCTION. data/README.md describes the formats.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from .datafiles import DataError, read_rows
from .rewards import MAX_DIGITS, normalize_number
from .settings import ALLOWED, REFUSED, Section, check, setting

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str         # full solution text ending in '#### N'
    ground_truth: str   # N, commas removed
    where: str = field(default="", compare=False)   # 'FILE line 7': where a refused row is

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": f"{self.question} {INSTRUCTION}"}]


def parse_ground_truth(answer: str, where: str = "answer") -> str:
    """N of the answer's last '#### N', commas removed, refused unless the reward reads it as a number."""
    if "####" not in answer:
        raise DataError(f"{where}: answer has no '####' line ({answer[:60]!r}); GSM8K answers must end with '#### N'")
    written = answer.split("####")[-1].strip()
    truth = written.replace(",", "")
    if not truth:
        raise DataError(f"{where}: nothing after '####' in {answer[-60:]!r}; write '#### N'")
    if normalize_number(truth) is None:
        shown = written if len(written) <= 40 else f"{written[:40]}..."
        raise DataError(f"{where}: field 'answer' ends with {'#### ' + shown!r}, which the reward cannot read as a "
                        f"number to compare completions with (such as 18, -3, 1,000 or $2.50, at most {MAX_DIGITS:,} "
                        f"digits); write the answer's last line as '#### N' with N a number")
    return truth


def _problem(loc: str, row: dict) -> Problem:
    for key in ("question", "answer"):
        if key not in row:
            raise DataError(f"{loc}: missing field '{key}'; each row needs 'question' and 'answer'")
        if row[key] is None:
            raise DataError(f"{loc}: field '{key}' is empty (null); give a non-empty string")
        if not isinstance(row[key], str):
            raise DataError(f"{loc}: field '{key}' is a {type(row[key]).__name__} ({row[key]!r:.60}), not a "
                            f"string; write it as text (quoted in JSON)")
        if not row[key].strip():
            raise DataError(f"{loc}: field '{key}' is empty; give a non-empty string")
        try:
            row[key].encode("utf-8")
        except UnicodeEncodeError as err:   # JSON's '\ud800' escape: half of a UTF-16 pair, no character
            raise DataError(f"{loc}: field '{key}' holds {row[key][err.start]!r} at character {err.start + 1}, a "
                            f"lone UTF-16 surrogate (an escape such as \\ud800 without its pair), which is not "
                            f"text; write the character itself, or the escape's whole pair") from err
    return Problem(row["question"].strip(), row["answer"], parse_ground_truth(row["answer"], loc), loc)


def load_gsm8k(split: str = "train", source: str = "hub") -> list[Problem]:
    """openai/gsm8k's `split` (source='hub'), or every row of a local .jsonl or .parquet file."""
    rows = read_rows(source, split)
    if not rows:
        where = f"openai/gsm8k[{split}]" if source == "hub" else str(source)
        raise DataError(f"{where}: no rows; the file must hold at least one question/answer row")
    return [_problem(loc, row) for loc, row in rows]


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
    """`n` GSM8K-style problems, the same for the same (n, seed) whatever PYTHONHASHSEED."""
    rng = random.Random(seed)
    return [Problem(question, "\n".join(lines) + f"\n#### {value}", str(value))
            for question, lines, value in (_one_problem(rng) for _ in range(n))]


def final_line_variants(value: str) -> list[str]:
    """Ways a warm-started model may end its answer; only the first earns the strict reward."""
    return [f"#### {value}", f"The answer is {value}.", f"= {value}", f"{value}"]


def warmstart_completion(problem: Problem, rng: random.Random, strict_fraction: float) -> str:
    """SFT target: the reasoning, then '#### N' only `strict_fraction` of the time (GRPO has a format to learn)."""
    reasoning = problem.answer.rsplit("####", 1)[0].strip()
    variants = final_line_variants(problem.ground_truth)
    final = variants[0] if rng.random() < strict_fraction else rng.choice(variants[1:])
    return f"{reasoning}\n{final}"


def prompt_ids(tokenizer, messages: list[dict], enable_thinking: bool = False) -> list[int]:
    """Chat-formatted prompt tokens ending with the assistant header."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes of text one token covers: the longest vocabulary entry in UTF-8 (an
    overcount), with a margin when a normalizer (NFC/NFKC) may shorten text before it is split."""
    longest = max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return longest * (4 if backend is None or backend.normalizer is not None else 1)


def overlong_prompts(problems: list[Problem], tokenizer, limit: int, enable_thinking: bool = False) -> list[tuple]:
    """(problem, how long) for each prompt over `limit` tokens. A question of more than limit x max_token_bytes
    bytes is refused by its length and never tokenised (a 50 MB row costs nothing)."""
    byte_bound = limit * max_token_bytes(tokenizer)
    over = []
    for problem in problems:
        nbytes = len(problem.question.encode("utf-8"))
        if nbytes > byte_bound:
            over.append((problem, f"{nbytes:,} bytes, so more than {limit} tokens; not tokenised"))
            continue
        n = len(prompt_ids(tokenizer, problem.messages, enable_thinking))
        if n > limit:
            over.append((problem, f"{n} tokens"))
    return over


def step_problems(seed: int, step: int, n: int) -> list[Problem]:
    """One GRPO step's synthetic problems, a pure function of (seed, step) (a resumed run sees the same)."""
    return synthetic_problems(n, f"train-{seed}-{step}")


def check_source_paths(source: str, eval_source: str = "") -> None:
    for field_name, value in (("data.source", source), ("data.eval_source", eval_source)):
        if not value or value in ("synthetic", "hub") or Path(value).is_file():
            continue
        path = Path(value)
        what = ("does not exist" if not path.exists() else "is a directory" if path.is_dir() else
                "is not a regular file (a FIFO or device would be read without end)")
        raise DataError(f"{field_name}={value!r}: dataset file {value} {what}; pass a .jsonl or .parquet file with "
                        f"question/answer fields, 'hub' or 'synthetic'")


_EVALUATION = "evaluation only (each evals.jsonl row carries its n)"


@dataclass
class DataSettings(Section):
    """The `data` section: where training and held-out problems come from, and how many are scored."""
    source: str = setting("synthetic", "'synthetic' (seeded GSM8K-style generator), 'hub' (openai/gsm8k) "
                          "or a local .jsonl/.parquet file with question/answer fields.",
                          resume=REFUSED, why="it defines the data stream: which problems each step draws")
    eval_source: str = setting("", "Held-out set; '' = same kind as source (fresh synthetic seeds, or the "
                               "'test' split / same file).", resume=REFUSED,
                               why="it defines the held-out set the before/after evaluations compare")
    eval_size: int = setting(128, "Held-out prompts used for the before/after evaluation (>= 1).",
                             resume=ALLOWED, why=_EVALUATION)
    eval_samples: int = setting(2, "Samples per held-out prompt at the training sampling settings.",
                                resume=ALLOWED, why=_EVALUATION)
    max_prompt_tokens: int = setting(0, "Longest prompt (chat template included) a dataset row may have; rows "
                                     "above it are refused before the run starts, with a count and the first one. "
                                     "0 = the model's context minus grpo.max_new_tokens.",
                                     resume=ALLOWED, why="a guard checked before the run starts")

    def problems(self) -> list[str]:
        return [*check(self.eval_size >= 1, f"data.eval_size={self.eval_size}: the before/after evaluation needs at "
                       f"least one held-out prompt; set data.eval_size=128 (or 4 for a quick check)"),
                *check(self.eval_samples >= 1, f"data.eval_samples={self.eval_samples}: must be >= 1"),
                *check(self.max_prompt_tokens >= 0, f"data.max_prompt_tokens={self.max_prompt_tokens}: must be >= 0 "
                       f"(0 = the model's context minus grpo.max_new_tokens)")]


class ProblemSource:
    """Training and held-out problems from the configured source; `eval_size` x `eval_samples` per evaluation."""

    @classmethod
    def from_settings(cls, data: DataSettings, seed: int) -> ProblemSource:
        return cls(data.source, seed, data.eval_source, data.eval_size, data.eval_samples)

    def __init__(self, source: str, seed: int, eval_source: str = "", eval_size: int = 128, eval_samples: int = 2):
        check_source_paths(source, eval_source)
        self.source, self.seed, self._eval_source = source, seed, eval_source
        self.eval_size, self.eval_samples = eval_size, eval_samples
        self._eval: list[Problem] | None = None   # read once: evaluate() runs it at least twice
        # a file's bad rows fail now, before any step runs
        self._train = None if source in ("synthetic", "hub") else load_gsm8k("train", source)

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
        if self._eval is None:
            self._eval = load_gsm8k("test" if source == "hub" else "train", source)
        return self._eval[:n]
