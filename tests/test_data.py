"""Problems: the seeded synthetic generator, local jsonl/parquet files read with bounded memory,
errors naming file + line (or row), the prompt-length guard, and the committed sample file."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lorabench.data import (
    INSTRUCTION,
    DataError,
    Problem,
    ProblemSource,
    load_gsm8k,
    overlong_prompts,
    parse_ground_truth,
    prompt_ids,
    step_problems,
    synthetic_problems,
)
from lorabench.datafiles import MAX_ROW_BYTES
from lorabench.rewards import gsm8k_reward, normalize_number

ROOT = Path(__file__).resolve().parents[1]


def test_synthetic_deterministic_per_seed():
    assert synthetic_problems(20, 3) == synthetic_problems(20, 3)
    assert synthetic_problems(20, "train-0-1") == synthetic_problems(20, "train-0-1")
    # a prefix of a longer list: the generator walks one seeded sequence
    assert synthetic_problems(5, 3) == synthetic_problems(20, 3)[:5]


def test_synthetic_differs_across_seeds():
    a = [p.question for p in synthetic_problems(20, 1)]
    b = [p.question for p in synthetic_problems(20, 2)]
    assert a != b
    assert len(set(a) & set(b)) < 10


def test_step_problems_fresh_every_step():
    s1, s2, s3 = (step_problems(0, step, 16) for step in (1, 2, 3))
    assert step_problems(0, 2, 16) == s2  # a pure function of (seed, step)
    q1, q2, q3 = ({p.question for p in s} for s in (s1, s2, s3))
    assert q1 != q2 and q2 != q3
    assert len(q1 & q2) < 8 and len(q2 & q3) < 8
    assert step_problems(1, 1, 16) != s1  # and of the seed


def test_train_and_eval_streams_mostly_disjoint():
    source = ProblemSource("synthetic", seed=0)
    train = {p.question for step in range(1, 11) for p in source.train_batch(step, 32)}
    held_out = [p.question for p in source.eval_set(64)]
    assert source.eval_set(64) == source.eval_set(64)
    overlap = sum(q in train for q in held_out)
    # the generator has a finite space, so a few collisions are possible; most must be new
    assert overlap < len(held_out) // 4, overlap


def test_ground_truth_parses_and_matches_answer():
    for p in synthetic_problems(200, 5):
        assert p.answer.rstrip().splitlines()[-1] == f"#### {p.ground_truth}"
        assert normalize_number(p.ground_truth) == p.ground_truth
        assert int(p.ground_truth) >= 0
        assert parse_ground_truth(p.answer) == p.ground_truth
        assert gsm8k_reward(p.answer, p.ground_truth) == 1.0
        # the reasoning lines really compute the answer
        last_eq = p.answer.split("####")[0].strip().splitlines()[-1]
        assert f"= {p.ground_truth} " in last_eq


def test_problem_messages():
    p = synthetic_problems(1, 0)[0]
    assert p.messages == [{"role": "user", "content": p.question + " " + INSTRUCTION}]
    assert p.messages[0]["content"] == (
        p.question + ' Let\'s think step by step and output the final answer after "####".')


ROWS = [
    {"question": "Tom has 3 apples and buys 1,000 more. How many?", "answer": "3 + 1000 = 1003\n#### 1,003"},
    {"question": "  Ana has 5 pens and loses 2. How many are left?  ", "answer": "5 - 2 = 3\n#### 3"},
]


def _write_jsonl(path, rows, extra_lines=()):
    path.write_text("\n".join([json.dumps(r) for r in rows] + list(extra_lines)) + "\n")
    return path


def test_load_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", ROWS, extra_lines=[""])  # a blank line is skipped
    problems = load_gsm8k("train", str(path))
    assert [p.ground_truth for p in problems] == ["1003", "3"]
    assert problems[1].question == ROWS[1]["question"].strip()
    assert problems[0].answer == ROWS[0]["answer"]
    assert all(isinstance(p, Problem) for p in problems)


def test_load_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = tmp_path / "train.parquet"
    pd.DataFrame(ROWS).to_parquet(path)
    assert load_gsm8k("train", str(path)) == load_gsm8k("train", str(_write_jsonl(tmp_path / "t.jsonl", ROWS)))


def test_problem_source_from_file_walks_dataset(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(10)]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    source = ProblemSource(str(path), seed=0)
    first = source.train_batch(0, 5) + source.train_batch(1, 5)
    assert sorted(p.question for p in first) == sorted(r["question"] for r in rows)  # one epoch, no repeats
    assert source.train_batch(2, 5) == source.train_batch(0, 5)                    # then it wraps around
    assert len(source.eval_set(3)) == 3


def _data_error(tmp_path, lines) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        load_gsm8k("train", str(path))
    msg = str(info.value)
    assert str(path) in msg
    return msg


def test_missing_file(tmp_path):
    path = tmp_path / "missing.jsonl"
    with pytest.raises(DataError) as info:
        load_gsm8k("train", str(path))
    assert str(path) in str(info.value) and "does not exist" in str(info.value)


def test_row_without_hashes(tmp_path):
    msg = _data_error(tmp_path, [json.dumps(ROWS[0]), json.dumps({"question": "q?", "answer": "it is 4"})])
    assert "line 2" in msg and "####" in msg


def test_nothing_after_hashes(tmp_path):
    msg = _data_error(tmp_path, [json.dumps({"question": "q?", "answer": "4\n####  "})])
    assert "line 1" in msg and "####" in msg


def test_empty_question(tmp_path):
    msg = _data_error(tmp_path, [json.dumps(ROWS[0]), "", json.dumps(ROWS[1]),
                                 json.dumps({"question": "   ", "answer": "#### 4"})])
    assert "line 4" in msg and "'question'" in msg and "empty" in msg   # the file's line, blank lines counted


def test_missing_field(tmp_path):
    msg = _data_error(tmp_path, [json.dumps({"question": "q?"})])
    assert "line 1" in msg and "missing field 'answer'" in msg


def test_non_string_field(tmp_path):
    msg = _data_error(tmp_path, [json.dumps({"question": "q?", "answer": 4})])
    assert "line 1" in msg and "'answer'" in msg


def test_bad_json_line(tmp_path):
    msg = _data_error(tmp_path, [json.dumps(ROWS[0]), '{"question": "q?", "answer": '])
    assert "line 2" in msg and "not valid JSON" in msg


def test_empty_file(tmp_path):
    msg = _data_error(tmp_path, [""])
    assert "no rows" in msg


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("question,answer\n")
    with pytest.raises(DataError, match=r"\.csv"):
        load_gsm8k("train", str(path))


def test_json_line_that_is_not_an_object(tmp_path):
    msg = _data_error(tmp_path, [json.dumps(ROWS[0]), json.dumps(["q?", "#### 4"])])
    assert "line 2" in msg and "a list, not a JSON object" in msg and '"question"' in msg


def test_bom_accepted_in_jsonl(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in ROWS).encode() + b"\n")
    assert [p.ground_truth for p in load_gsm8k("train", str(path))] == ["1003", "3"]


def test_jsonl_not_utf8_names_file_line_and_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    latin1 = '{"question": "Zo\xeb?", "answer": "#### 1"}\n'.encode("latin-1")
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + latin1)
    with pytest.raises(DataError) as info:
        load_gsm8k("train", str(path))
    msg = str(info.value)
    assert str(path) in msg and "line 2" in msg and "not UTF-8" in msg and "0xeb" in msg
    assert "save the file as UTF-8" in msg


def test_overlong_lines_counted_without_holding_them(tmp_path):
    """Lines over MAX_ROW_BYTES are skipped in pieces (never held whole) and reported with a count
    and the first one; the rows around them are fine."""
    path = tmp_path / "long.jsonl"
    big = json.dumps({"question": "x" * (3 * MAX_ROW_BYTES), "answer": "#### 1"})
    path.write_text("\n".join([json.dumps(ROWS[0]), big, json.dumps(ROWS[1]), big]) + "\n")
    with pytest.raises(DataError) as info:
        load_gsm8k("train", str(path))
    msg = str(info.value)
    assert str(path) in msg and "2 line(s) longer than 1,048,576 bytes" in msg and "line 2" in msg
    assert f"{len(big) + 1:,} bytes" in msg and "remove or shorten" in msg
    path.write_text(json.dumps({"question": "x" * (MAX_ROW_BYTES - 100), "answer": "#### 1"}) + "\n")
    assert len(load_gsm8k("train", str(path))) == 1                 # just under the bound: read


def test_parquet_errors_name_file_column_and_row(tmp_path):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "d.parquet"
    pd.DataFrame({"question": ["q?"], "answer": [4]}).to_parquet(path)
    with pytest.raises(DataError, match=r"column 'answer' holds int64, not text; write it as strings"):
        load_gsm8k("train", str(path))
    pd.DataFrame({"question": ["q?"], "solution": ["#### 4"]}).to_parquet(path)
    with pytest.raises(DataError, match=r"no column 'answer'; the columns are \['question', 'solution'\]"):
        load_gsm8k("train", str(path))
    pd.DataFrame({"question": ["q?", None], "answer": ["#### 4", "#### 5"]}).to_parquet(path)
    with pytest.raises(DataError, match=r"row 2: field 'question' is empty \(null\)"):
        load_gsm8k("train", str(path))
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"is not a readable parquet file"):
        load_gsm8k("train", str(path))


def test_parquet_overlong_value_not_materialised(tmp_path):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "d.parquet"
    pd.DataFrame({"question": ["q?", "y" * (2 * MAX_ROW_BYTES)], "answer": ["#### 4", "#### 5"]}).to_parquet(path)
    with pytest.raises(DataError) as info:
        load_gsm8k("train", str(path))
    assert "1 row(s) longer than" in str(info.value) and "row 2 (2,097,158 bytes)" in str(info.value)


# --- the prompt-length guard -------------------------------------------------------------------------
def test_overlong_prompts_counted_by_tokens_or_by_bytes(tokenizer):
    """A prompt over the limit is found by its token count; a question too long in *bytes* to fit
    however it tokenises is found without tokenising it (a 50 MB row costs nothing)."""
    from lorabench.data import max_token_bytes
    normal = synthetic_problems(3, 0)
    limit = max(len(prompt_ids(tokenizer, p.messages)) for p in normal)
    assert overlong_prompts(normal, tokenizer, limit) == []
    assert [p for p, _ in overlong_prompts(normal, tokenizer, limit - 1)]  # the longest is over by one
    longer = Problem("one two three " * 20, "#### 1", "1", "f line 9")
    huge = Problem("z" * (limit * max_token_bytes(tokenizer) + 1), "#### 1", "1", "f line 12")
    over = overlong_prompts([*normal, longer, huge], tokenizer, limit)
    assert [(p.where, why.split(",")[0]) for p, why in over] == [
        ("f line 9", f"{len(prompt_ids(tokenizer, longer.messages))} tokens"),
        ("f line 12", f"{len(huge.question):,} bytes")]
    assert "not tokenised" in over[1][1]
    tokenizer_calls = []
    real = tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda *a, **k: tokenizer_calls.append(1) or real(*a, **k)
    try:
        overlong_prompts([huge], tokenizer, limit)
    finally:
        del tokenizer.apply_chat_template
    assert tokenizer_calls == []


# --- data/gsm8k_sample.jsonl -------------------------------------------------------------------------
def test_committed_sample_is_what_the_generator_writes(tmp_path):
    """The sample file holds nothing the project did not write: regenerating it gives the same bytes."""
    committed = ROOT / "data" / "gsm8k_sample.jsonl"
    out = tmp_path / "sample.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "data" / "write_sample.py"), str(out)], cwd=tmp_path,
                          capture_output=True, text=True, check=True)
    assert "wrote 48 rows" in done.stdout
    assert out.read_bytes() == committed.read_bytes()
    problems = load_gsm8k("train", str(committed))             # a valid local-file source
    assert len(problems) == 48 and problems[5].where == f"{committed} line 6"
    assert problems == synthetic_problems(48, "sample-0")
