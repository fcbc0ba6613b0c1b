"""Problems: the seeded synthetic generator, local jsonl/parquet files, and errors naming file + row."""
import json

import pytest

from lorabench.data import (INSTRUCTION, DataError, Problem, ProblemSource, load_gsm8k, parse_ground_truth,
                            step_problems, synthetic_problems)
from lorabench.rewards import gsm8k_reward, normalize_number


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
    assert "row 2" in msg and "####" in msg


def test_nothing_after_hashes(tmp_path):
    msg = _data_error(tmp_path, [json.dumps({"question": "q?", "answer": "4\n####  "})])
    assert "row 1" in msg and "####" in msg


def test_empty_question(tmp_path):
    msg = _data_error(tmp_path, [json.dumps(ROWS[0]), json.dumps(ROWS[1]),
                                 json.dumps({"question": "   ", "answer": "#### 4"})])
    assert "row 3" in msg and "'question'" in msg and "empty" in msg


def test_missing_field(tmp_path):
    msg = _data_error(tmp_path, [json.dumps({"question": "q?"})])
    assert "row 1" in msg and "missing field 'answer'" in msg


def test_non_string_field(tmp_path):
    msg = _data_error(tmp_path, [json.dumps({"question": "q?", "answer": 4})])
    assert "row 1" in msg and "'answer'" in msg


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
